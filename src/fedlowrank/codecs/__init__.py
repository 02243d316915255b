"""Codecs between a method's messages and the wire: lossy stages (fp16/bf16 casts, blockwise absmax int8/int4 with
uniform or NF4 levels, top-k), a lossless stage, error feedback on the uplink (``docs/codecs.md``).

* :mod:`.settings` — the ``[uplink]`` and ``[downlink]`` config sections and their rules;
* :mod:`.kernels` — the pure tensor kernels (quantisation, packing, top-k);
* :mod:`.lossless` — zlib, lzma, zstd with a bound on the decompressed size, and :class:`CodecError`;
* :mod:`.link` — :class:`Link`, one direction's codec on whole messages: what the runtime calls at the wire.
"""

from .link import HEADER, PART, RESIDUAL, Link, residual_entries, split_state
from .lossless import CodecError
from .settings import CODECS, CodecSection, DownlinkSection, UplinkSection, check_codec

__all__ = ["CODECS", "CodecError", "CodecSection", "DownlinkSection", "HEADER", "Link", "PART", "RESIDUAL",
           "UplinkSection", "check_codec", "residual_entries", "split_state"]
