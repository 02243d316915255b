"""The ``[uplink]`` and ``[downlink]`` config sections: which codec each direction's messages go through
(``docs/codecs.md``).

Both sections declare the same codec keys (:class:`CodecSection`); the uplink adds ``error_feedback``. Rules
between keys (an option that its codec does not read, NF4 levels at 8 bits, error feedback without a lossy codec)
are :func:`check_codec`'s, one line naming the keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schema import ConfigError, Schema, declared, setting

CODECS = ("", "fp16", "bf16", "int8", "int4", "topk")  # "" = none: the message as the method made it
DOWNLINK_CODECS = CODECS[:-1]  # top-k would send a sparse model: a broadcast is the model itself, not an update
QUANTIZED = ("int8", "int4")  # blockwise absmax codecs
LEVELS = ("uniform", "nf4")
ROUNDING = ("nearest", "stochastic")
VALUE_DTYPES = ("fp32", "fp16", "bf16")  # top-k's values
LOSSLESS = ("none", "zlib", "lzma", "zstd")  # zstd: the zstandard package (fedlowrank[zstd])
BITS = {"int8": 8, "int4": 4}
_CODEC = ("lossy stage applied to every floating tensor a method does not declare exact: '' (none), fp16 or bf16 "
          "casts, int8 or int4 blockwise absmax quantisation")


@dataclass
class CodecSection(Schema):
    """One direction's codec: a lossy stage (``codec`` and its options), then a lossless one (``lossless``)."""

    prefix = "codec"

    codec: str = setting("", _CODEC + " (docs/codecs.md; top-k is the uplink's: a broadcast is the model itself)",
                         choices=DOWNLINK_CODECS)
    block: int = setting(64, "int8/int4: entries per block, each block scaled by its largest magnitude", ge=2,
                         le=1 << 20, reason="a block larger than 2^20 entries is one scale for a whole tensor")
    levels: str = setting("uniform", "int8/int4: the quantisation levels of a block: uniform (2^(b-1)-1 steps each "
                          "side of 0) or nf4 (QLoRA's 16 NormalFloat levels; int4 only)", choices=LEVELS)
    rounding: str = setting("nearest", "int8/int4: round to the nearest level, or stochastically between the two "
                            "nearest (unbiased; seeded per run, client and round)", choices=ROUNDING)
    lossless: str = setting("none", "lossless stage on the whole coded message: none, zlib or lzma (Python's), or "
                            "zstd (the zstandard package: pip install fedlowrank[zstd])", choices=LOSSLESS)
    lossless_level: int = setting(0, "compression level of the lossless stage (0 = the library's default; zlib and "
                                  "lzma 1 to 9, zstd 1 to 22)", ge=0, le=22)

    @property
    def active(self) -> bool:
        """Whether the direction's messages are coded at all."""
        return bool(self.codec) or self.lossless != "none"

    @property
    def feedback(self) -> bool:
        """Whether the codec keeps error feedback's residuals (the uplink's ``error_feedback``)."""
        return False

    def describe(self) -> str:
        """The codec in a few words: ``int4 nf4 b64 stochastic + ef + zstd``; ``fp32`` when none."""
        parts = [self.codec or "fp32"]
        if self.codec in QUANTIZED:
            parts += [self.levels, f"b{self.block}", self.rounding]
        elif self.codec == "topk":
            parts += [f"k={self.topk_count}" if self.topk_count else f"{self.topk_fraction:g}", self.values]
        if self.feedback:
            parts.append("+ ef")
        if self.lossless != "none":
            parts.append(f"+ {self.lossless}")
        return " ".join(parts)


@dataclass
class UplinkSection(CodecSection):
    """Config section ``[uplink]``: the codec of every client's reply (top-k among them), with optional error
    feedback."""

    prefix = "uplink"

    codec: str = setting("", _CODEC + ", or topk sparsification (docs/codecs.md)", choices=CODECS)
    topk_fraction: float = setting(0.1, "topk: share of each tensor's entries sent (the largest in magnitude; at "
                                   "least one)", gt=0, le=1)
    topk_count: int = setting(0, "topk: entries sent per tensor instead of topk_fraction (0 = use topk_fraction)",
                              ge=0)
    values: str = setting("fp32", "topk: the dtype the kept values travel in", choices=VALUE_DTYPES)
    error_feedback: bool = setting(False, "keep what the lossy codec dropped in the client's state and add it to "
                                   "its next upload (needs uplink.codec)")

    @property
    def feedback(self) -> bool:
        return self.error_feedback


@dataclass
class DownlinkSection(CodecSection):
    """Config section ``[downlink]``: the codec of every broadcast. No error feedback: a broadcast is a whole model
    that replaces what the client held, so an error carried into the next one would add to it (docs/codecs.md)."""

    prefix = "downlink"


# the options each codec reads; every other option left off its default is refused (one line)
_READS = {"": (), "fp16": (), "bf16": (), "int8": ("block", "levels", "rounding"),
          "int4": ("block", "levels", "rounding"), "topk": ("topk_fraction", "topk_count", "values")}
_OPTIONS = ("block", "levels", "rounding", "topk_fraction", "topk_count", "values")


def check_codec(section: CodecSection) -> None:
    """:class:`ConfigError`, one line naming the keys, for options that ``section``'s codec does not read (set off
    their defaults), NF4 levels at 8 bits, a compression level without a lossless stage or beyond zlib's and lzma's
    9, and error feedback without a lossy codec."""
    p, defaults = section.prefix, UplinkSection()
    for key in (k for k in _OPTIONS if k in declared(type(section))):
        if key not in _READS[section.codec] and getattr(section, key) != getattr(defaults, key):
            readers = [c for c, reads in _READS.items() if key in reads]
            raise ConfigError(f"{p}.{key} = {getattr(section, key)!r} changes nothing with {p}.codec = "
                              f"{section.codec!r}: it is an option of {p}.codec = {' or '.join(readers)}")
    if section.codec == "int8" and section.levels == "nf4":
        raise ConfigError(f"{p}.levels = 'nf4' needs {p}.codec = 'int4' (NormalFloat has 16 levels); with int8 use "
                          f"{p}.levels = 'uniform'")
    if section.lossless_level and section.lossless == "none":
        raise ConfigError(f"{p}.lossless_level = {section.lossless_level} needs a lossless stage: set {p}.lossless "
                          f"to zlib, lzma or zstd")
    if section.lossless in ("zlib", "lzma") and section.lossless_level > 9:
        raise ConfigError(f"{p}.lossless_level must be in [0, 9] with {p}.lossless = {section.lossless!r}, got "
                          f"{section.lossless_level}")
    if section.feedback and not section.codec:
        raise ConfigError(f"{p}.error_feedback = true needs a lossy {p}.codec (fp16, bf16, int8, int4 or topk): "
                          f"without one nothing is dropped")
