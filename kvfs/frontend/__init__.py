"""kvfs's FUSE front end: the libfuse 3 low-level API in C threads (_loop.c), requests into the Operations on the
trio thread (bridge.py); `api` is what the rest of kvfs imports (docs/frontend.md).
"""
