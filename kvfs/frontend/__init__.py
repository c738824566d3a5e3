"""kvfs's FUSE front ends: the native one (libfuse 3 low-level API in C threads, _loop.c + bridge.py) and,
until it replaces it, pyfuse3. `api` is what the rest of kvfs imports in place of pyfuse3 (docs/frontend.md).
"""
