"""A small Server-Sent Events client for the tests: parses ``id:``/``data:`` frames and comments.

It reads the body as chunks arrive (``iter_content(chunk_size=None)``), so a frame is seen as soon
as the server sends it; ``first_byte_at`` is the monotonic time the first bytes arrived.
"""
from __future__ import annotations

import json
import time

import requests


class SSEStream:
    """Iterate ``(id, data_dict)`` frames of one event stream; comments are kept in ``comments``."""

    def __init__(self, url: str, headers: dict, timeout: float = 120, last_event_id: str | None = None,
                 session: requests.Session | None = None):
        if last_event_id is not None:
            headers = {**headers, "Last-Event-ID": last_event_id}
        self._attach((session or requests).get(url, headers=headers, stream=True, timeout=timeout))

    @classmethod
    def of(cls, response: requests.Response) -> SSEStream:
        """Read a stream already requested (``stream=True``)."""
        stream = cls.__new__(cls)
        stream._attach(response)
        return stream

    def _attach(self, response: requests.Response) -> None:
        self.response = response
        self.response.raise_for_status()
        self.comments: list[str] = []
        self.first_byte_at: float | None = None
        self._lines = self._iter_lines()

    def _iter_lines(self):
        buf = b""
        for chunk in self.response.iter_content(chunk_size=None):
            if self.first_byte_at is None:
                self.first_byte_at = time.monotonic()
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                yield line.rstrip(b"\r").decode("utf-8")

    def __iter__(self):
        event_id, data = None, []
        for line in self._lines:
            if line == "":
                if data:
                    yield event_id, json.loads("\n".join(data))
                event_id, data = None, []
            elif line.startswith(":"):
                self.comments.append(line[1:].strip())
            elif line.startswith("id:"):
                event_id = line[3:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())

    def close(self) -> None:
        self.response.close()


def read_all(url: str, headers: dict, **kw) -> list[tuple[str, dict]]:
    stream = SSEStream(url, headers, **kw)
    try:
        return list(stream)
    finally:
        stream.close()
