"""The lossless stage: the bytes of a coded message compressed whole, and decompressed with a bound on their size.

``zlib`` and ``lzma`` are Python's; ``zstd`` is the zstandard package (``pip install fedlowrank[zstd]``), imported
here only. Decompression never makes more than ``limit`` bytes: a payload that would is refused
(:class:`CodecError`), so that a small reply cannot expand into a huge one on the server.
"""

from __future__ import annotations

import importlib.util
import lzma
import zlib

from ..serialization import FormatError


class CodecError(FormatError):
    """A coded message that does not decode: the message says why (a bad header, a part of the wrong length, a code
    or an index out of range, a payload that does not decompress)."""


def require(kind: str, key: str) -> None:
    """One line naming ``key`` when the library of the lossless stage ``kind`` is not installed."""
    if kind == "zstd" and importlib.util.find_spec("zstandard") is None:
        raise ValueError(f"{key} = 'zstd' needs the zstandard package: pip install 'fedlowrank[zstd]' (or use zlib "
                         f"or lzma, which Python ships)")


def compress(data: bytes, kind: str, level: int = 0) -> bytes:
    """``data`` compressed by ``kind`` (``zlib``, ``lzma``, ``zstd``) at ``level`` (0 = the library's default)."""
    if kind == "zlib":
        return zlib.compress(data, level or -1)
    if kind == "lzma":
        return lzma.compress(data, preset=level or lzma.PRESET_DEFAULT)
    import zstandard

    return zstandard.ZstdCompressor(level=level or 3).compress(data)


def decompress(data: bytes, kind: str, limit: int | None) -> bytes:
    """The bytes ``data`` decompresses to by ``kind``; :class:`CodecError` when it does not, or when they would be
    more than ``limit`` (``None``: no bound)."""
    bound = (1 << 62) if limit is None else limit
    try:
        if kind == "zlib":
            d = zlib.decompressobj()
            out = d.decompress(data, bound + 1)
            done = d.eof and not d.unconsumed_tail and not d.unused_data
        elif kind == "lzma":
            d = lzma.LZMADecompressor()
            out = d.decompress(data, max_length=bound + 1)
            done = d.eof and not d.unused_data
        else:
            import zstandard

            size = zstandard.frame_content_size(data)  # written by compress: refused when absent or too large
            if not 0 <= size <= bound:
                raise CodecError(f"the zstd payload declares {size} bytes, not a size within the bound of {limit}")
            d = zstandard.ZstdDecompressor().decompressobj()
            out = d.decompress(data)
            done = d.eof and not d.unused_data and len(out) == size
    except CodecError:
        raise
    except (zlib.error, lzma.LZMAError, ValueError, EOFError, MemoryError) as exc:
        raise CodecError(f"the {kind} payload does not decompress ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - zstandard.ZstdError and friends
        raise CodecError(f"the {kind} payload does not decompress ({type(exc).__name__}: {exc})") from None
    if len(out) > bound:
        raise CodecError(f"the {kind} payload decompresses to more than the bound of {limit} bytes")
    if not done:
        raise CodecError(f"the {kind} payload is truncated or has trailing bytes")
    return out
