"""Models: loading ``task.model`` (bundled names, local folders, hub ids), ResNet-20, sentence embeddings.

Importing the package keeps one line of bitsandbytes out of every command's output (peft imports bitsandbytes
whenever it is installed): on a CPU with AVX-512 BF16 its backend warns at import that it could not fetch the
optional ``kernels`` package's faster 4-bit kernel from the hub, then uses its own kernel, so the line asks nothing
of a run (:class:`OptionalKernelNotice`)."""

import logging


class OptionalKernelNotice(logging.Filter):
    """Drops bitsandbytes' import-time warning ``Failed to load CPU gemm_4bit_forward from kernels-community``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward")


BITSANDBYTES_CPU_LOGGER = logging.getLogger("bitsandbytes.backends.cpu.ops")
if not any(isinstance(f, OptionalKernelNotice) for f in BITSANDBYTES_CPU_LOGGER.filters):
    BITSANDBYTES_CPU_LOGGER.addFilter(OptionalKernelNotice())
