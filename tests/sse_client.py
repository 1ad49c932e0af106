"""A small Server-Sent Events client for the tests: parses ``id:``/``data:`` frames and comments."""
from __future__ import annotations

import json

import requests


class SSEStream:
    """Iterate ``(id, data_dict)`` frames of one event stream; comments are kept in ``comments``."""

    def __init__(self, url: str, headers: dict, timeout: float = 120, last_event_id: str | None = None):
        if last_event_id is not None:
            headers = {**headers, "Last-Event-ID": last_event_id}
        self.response = requests.get(url, headers=headers, stream=True, timeout=timeout)
        self.comments: list[str] = []
        self._lines = self.response.iter_lines(decode_unicode=True)

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

    def until(self, name: str) -> list[tuple[str, dict]]:
        """Read frames up to and including the first event named ``name``."""
        out = []
        for frame in self:
            out.append(frame)
            if frame[1]["event"] == name:
                return out
        raise AssertionError(f"stream ended before {name}: {out}")

    def close(self) -> None:
        self.response.close()


def read_all(url: str, headers: dict, **kw) -> list[tuple[str, dict]]:
    stream = SSEStream(url, headers, **kw)
    try:
        return list(stream)
    finally:
        stream.close()
