"""CRC-32C of memory in place: every load's check of a saved checkpoint's bytes
(``loading/checksums.py``, ``backends/pread.py``) and the node cache's check of every block it serves.

The function is crc32c-rs's (Rust, public domain): hardware CRC-32C that folds the data with
carry-less multiplies, reads any buffer in place (a tensor's memory, a bytearray: no copy) and
releases the GIL, so the reader threads check in parallel. On a CPU with AVX-512 and VPCLMULQDQ
its ``*_vpclmulqdq_*`` variants are the fast ones; the package's own dispatch picks by CPU model
and, on a model it does not know (this project's VM reports a bare "Intel Xeon Processor"), chose
one that ran at 18 GiB/s there. So the VPCLMULQDQ variants are tried first, by name, each checked
against CRC-32C's check value before it is used, and the package's dispatch is taken where none
runs. Measured on this project's 2-core VM, 1 MiB in the core's cache, one thread: 47 GiB/s
(``v4s5x3``), 43 and 42 (the other two), 18 (the dispatch), against 3.6 GiB/s for
google-crc32c's C function, which distload called before (benchmarks/results/checksums.md has
what that does to a load).

A block is read and checked ``PIECE_BYTES`` at a time: a piece just read is still in the core's
cache (measured with google-crc32c, 256 MiB from the page cache: read alone 0.043 s, read then
check in 128-256 KiB pieces 0.055 s, everything read first and then checked 0.088 s).
"""

from __future__ import annotations

import functools

from distload.errors import BackendUnavailableError

PIECE_BYTES = 256 * 1024
# crc32c-rs's fastest variants on x86-64 with AVX-512VL and VPCLMULQDQ, fastest first (measured above).
FAST_VARIANTS = ("crc32c_avx512vl_vpclmulqdq_v4s5x3", "crc32c_avx512vl_vpclmulqdq_v3s1_s3",
                 "crc32c_avx512vl_vpclmulqdq_v3s2x4")
CHECK_VALUE = 0xE3069283  # CRC-32C of b"123456789" (RFC 3720's check value)


@functools.lru_cache(maxsize=1)
def _function():
    try:
        import crc32c_rs
    except ImportError:
        raise BackendUnavailableError(
            "distload checks a saved checkpoint's bytes and the node cache's blocks with CRC-32C: pip install "
            "crc32c-rs (a dependency of distload)") from None
    for name in FAST_VARIANTS:
        variant = getattr(crc32c_rs, name, None)
        if variant is None:
            continue
        try:
            if variant(b"123456789") == CHECK_VALUE:
                return variant
        except crc32c_rs.UnsupportedCPUFeatureError:
            continue
    if crc32c_rs.crc32c(b"123456789") != CHECK_VALUE:
        raise BackendUnavailableError("crc32c-rs computes a wrong CRC-32C on this machine (its check value "
                                      "differs): reinstall it (pip install --force-reinstall crc32c-rs)")
    return crc32c_rs.crc32c


def check_available() -> None:
    """Raise BackendUnavailableError now if the check cannot run (a load's planning calls it)."""
    _function()


def crc32c(view: memoryview, crc: int = 0) -> int:
    """CRC-32C of ``view`` (contiguous memory: a tensor's or a bytearray's), continuing ``crc``."""
    if len(view) == 0:
        return crc
    return _function()(view, crc)
