"""The bounds of the model pass-through (docs/sandbox.md §What the pass-through forwards): what
one user and all users may hold at once, how long a body may take, how many connections.
Read at each use, so a test may change one."""

MAX_USER_REQUESTS = 16               # one user's requests in flight at once (429 above)
USER_BODY_BUDGET = 16 * 1024 * 1024   # request body bytes held at once for one user (429; at
                                      # least the body cap: model_proxy.proxy.user_body_budget)
BODY_BUDGET = 256 * 1024 * 1024       # request body bytes held at once, every user (503 above)
BODY_SECONDS = 60.0                   # a body must arrive whole within this (408)
PARSES = 2                            # worker processes checking request bodies at once
INLINE_BYTES = 256 * 1024             # a body this small ...
INLINE_VALUES = 8192                  # ... holding at most this many JSON values: checked inline
INLINE_VALUE_BYTES = 64               # an inline body charged this per value (if above its size)
PARSE_SECONDS = 10.0                  # a body not checked within this: 400 request_too_complex
PARSE_WAIT_SECONDS = 10.0             # waiting for a worker longer: 503
PARSE_BYTES_PER_SECOND = 2 * 1024 * 1024   # what one user's bodies may cost to check (429)
PARSE_BURST_BYTES = 32 * 1024 * 1024  # ... its bucket (at least two bodies of the cap)
WORKER_BASE_BYTES = 256 * 1024 * 1024  # a worker's address space: this ...
WORKER_BYTES_PER_BODY_BYTE = 48       # ... plus this per byte of the body cap (RLIMIT_AS)
LINGER_SECONDS = 2.0                  # reading what a refused caller still sends (s)
DRAIN_BYTES = 64 * 1024 * 1024        # ... at most this much of its body
RESERVE_OUTPUT_TOKENS = 65536         # output reserved for a request naming no max_tokens
ORPHAN_SECONDS = 300.0                # a gone caller's answer read to its usage for at most ...
ORPHAN_BYTES = 16 * 1024 * 1024       # ... this long and this much (then counted at max_tokens)
READ_CHUNK = 64 * 1024                # largest piece relayed per read1()
POOL_SIZE = 8                         # idle upstream connections kept per origin
CONNECT_TIMEOUT = 10.0
CLIENT_TIMEOUT = 120.0                # idle keep-alive / a caller that stops reading or sending
MAX_CONNECTIONS = 512                 # client connections at once (one thread each); more: closed
