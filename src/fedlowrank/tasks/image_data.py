"""Image data: Fashion-MNIST from Debian's ``dataset-fashion-mnist``, folders of ``class/*.png``, Hugging Face image
sets by name, and the feature-shift **domains** (rotation, contrast, blur, noise, colour inversion).

Every loader returns an :class:`ImageData` with ``uint8`` images ``[N, C, H, W]`` (C = 1 or 3) and integer labels
in ``[0, K)``. Conversion to the model's input (channels, size, normalisation) is the task's business
(:mod:`fedlowrank.tasks.image`), done per batch with torch only (torchvision does not import beside the CPU torch).
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..seeding import numpy_rng, torch_generator
from .catalog import DataSet, held_out, register_data
from .hub import hub_splits

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
                       "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                         "Ankle boot")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
DOMAINS = ("clean", "rotate", "contrast", "blur", "noise", "invert")


def _with_domains(cfg, where: str) -> str:
    """``where`` and, with ``task.options.domains``, the domains (for :mod:`.catalog`)."""
    domains = cfg.task.options.get("domains")
    return where + (f", domains {', '.join(domains)}" if domains else "")


register_data(DataSet("fashion-mnist", "Fashion-MNIST", lambda cfg: _with_domains(
    cfg, f"Fashion-MNIST (classes {cfg.task.options.get('classes', 'all')})")))
register_data(DataSet("image-folder", "images", lambda cfg: _with_domains(
    cfg, f"image folder {cfg.data.train}" + (f" and {cfg.data.test}" if cfg.data.test else held_out(cfg.data)))))
register_data(DataSet("hf-images", "images", lambda cfg: _with_domains(
    cfg, f"Hugging Face image set {cfg.data.hf_name}")))


@dataclass
class ImageData:
    """Images ``uint8 [N, C, H, W]`` and ``int64 [N]`` labels of a train and a test split (labels index
    ``label_names``)."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    label_names: list[str]

    @property
    def num_labels(self) -> int:
        return len(self.label_names)


# -- Fashion-MNIST --------------------------------------------------------------------------------------------
def read_idx(path: str | Path) -> np.ndarray:
    """A gzip'd idx file (``uint8`` data): images ``[N, 28, 28]`` (header 16 bytes) or labels ``[N]`` (8 bytes)."""
    with gzip.open(path, "rb") as fh:
        raw = fh.read()
    magic = int.from_bytes(raw[:4], "big")
    if magic >> 8 != 0x08:  # 0x0801 labels, 0x0803 images: unsigned bytes
        raise ValueError(f"{path}: not an idx file of unsigned bytes (magic {magic:#x})")
    ndim = magic & 0xFF
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape} but holds {data.size} bytes")
    return data.reshape(shape)


def fashion_mnist_folder(path: str | Path = "") -> Path:
    folder = Path(path).expanduser() if path else FASHION_MNIST_DIR
    missing = [f for pair in FASHION_MNIST_FILES.values() for f in pair if not (folder / f).is_file()]
    if missing:
        raise ValueError(f"data.train: no Fashion-MNIST in {folder} (missing {missing[0]}); install Debian's "
                         f"package (apt-get install dataset-fashion-mnist) or point data.train at a folder "
                         f"holding the four idx.gz files")
    return folder


def load_fashion_mnist(path: str | Path = "", classes: list[int] | None = None) -> ImageData:
    """Fashion-MNIST (60,000 train / 10,000 test, 1×28×28), optionally only ``classes`` (original ids 0–9),
    relabelled ``0..len(classes)-1`` in the given order."""
    folder = fashion_mnist_folder(path)
    split = {}
    for name, (images, labels) in FASHION_MNIST_FILES.items():
        split[name] = (read_idx(folder / images)[:, None], read_idx(folder / labels).astype(np.int64))
    keep = list(range(10)) if classes is None else [int(c) for c in classes]
    if not keep or len(set(keep)) != len(keep) or not all(0 <= c < 10 for c in keep):
        raise ValueError(f"task.options.classes must be distinct Fashion-MNIST class ids in [0, 9], got {classes}")
    relabel = np.full(10, -1, dtype=np.int64)
    relabel[keep] = np.arange(len(keep))
    out = []
    for images, labels in split.values():
        mask = relabel[labels] >= 0
        out += [np.ascontiguousarray(images[mask]), relabel[labels[mask]]]
    return ImageData(*out, [FASHION_MNIST_CLASSES[c] for c in keep])


# -- folders of class/*.png -----------------------------------------------------------------------------------
def _read_image(path: Path, mode: str) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as img:
        arr = np.asarray(img.convert(mode))
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def _read_folder(folder: Path, names: list[str] | None) -> tuple[list[Path], list[str]]:
    if not folder.is_dir():
        raise ValueError(f"data.train/data.test: {folder} is not a folder of class sub-folders")
    classes = names or sorted(p.name for p in folder.iterdir() if p.is_dir())
    files, labels = [], []
    for c in classes:
        found = sorted(p for p in (folder / c).glob("*") if p.suffix.lower() in IMAGE_SUFFIXES) \
            if (folder / c).is_dir() else []
        files += found
        labels += [c] * len(found)
    if not files:
        raise ValueError(f"{folder}: no images ({', '.join(IMAGE_SUFFIXES)}) in class sub-folders")
    return files, labels


def load_image_folder(train: str | Path, test: str | Path | None = None, test_fraction: float = 0.2,
                      seed: int = 0) -> ImageData:
    """``train/<class>/*.png`` (and ``test/<class>/*.png``, else a stratified ``test_fraction`` split). Images are
    decoded with Pillow, as grayscale when every training image is single-channel, RGB otherwise; all must have
    the size of the first one (resizing to the model's input happens per batch)."""
    from PIL import Image

    train = Path(train).expanduser()
    files, labels = _read_folder(train, None)
    names = sorted(set(labels))
    if len(names) < 2:
        raise ValueError(f"{train}: needs at least two class sub-folders with images, found {names}")
    def opened(path: Path) -> tuple[tuple[int, int], str]:
        with Image.open(path) as img:
            return img.size, img.mode

    size = opened(files[0])[0]
    mode = "L" if all(opened(f)[1] in ("L", "1", "I;16") for f in files) else "RGB"
    test_files, test_labels = _read_folder(Path(test).expanduser(), names) if test else ([], [])

    def stack(paths: list[Path]) -> np.ndarray:
        arrays = []
        for p in paths:
            a = _read_image(p, mode)
            if (a.shape[2], a.shape[1]) != size:
                raise ValueError(f"{p}: size {a.shape[2]}×{a.shape[1]} differs from {size[0]}×{size[1]} "
                                 f"({files[0].name}); resize the folder's images to one size")
            arrays.append(a)
        return np.stack(arrays) if arrays else np.zeros((0, 1 if mode == "L" else 3, size[1], size[0]), np.uint8)

    index = {n: i for i, n in enumerate(names)}
    images, y = stack(files), np.array([index[c] for c in labels], dtype=np.int64)
    if test:
        return ImageData(images, y, stack(test_files), np.array([index[c] for c in test_labels], np.int64), names)
    rng = numpy_rng(seed, "train-test-split")
    is_test = np.zeros(len(y), dtype=bool)
    for c in range(len(names)):
        idx = rng.permutation(np.flatnonzero(y == c))
        is_test[idx[: int(round(test_fraction * len(idx)))]] = True
    return ImageData(images[~is_test], y[~is_test], images[is_test], y[is_test], names)


# -- Hugging Face image sets ----------------------------------------------------------------------------------
def load_hf_images(name: str, image_column: str = "image", label_column: str = "label") -> ImageData:
    """A ``datasets`` image set with ``train`` and ``test`` splits (needs the hub or its local cache)."""
    train, test = hub_splits(name, "data.source = 'hf-images'")
    feature = train.features[label_column]
    label_names = list(getattr(feature, "names", None) or sorted(set(train[label_column])))

    def convert(split) -> tuple[np.ndarray, np.ndarray]:
        first = split[0][image_column]
        mode = "L" if first.mode in ("L", "1") else "RGB"
        images = np.stack([np.asarray(img.convert(mode)) for img in split[image_column]])
        images = images[:, None] if images.ndim == 3 else images.transpose(0, 3, 1, 2)
        labels = split[label_column]
        if not getattr(feature, "names", None):
            labels = [label_names.index(v) for v in labels]
        return np.ascontiguousarray(images), np.asarray(labels, dtype=np.int64)

    return ImageData(*convert(train), *convert(test), [str(n) for n in label_names])


def subsample_images(data: ImageData, max_train: int, max_test: int, seed: int) -> ImageData:
    """Seeded random subsets of at most ``max_train``/``max_test`` examples (0 = all), order kept."""

    def pick(n: int, k: int, stream: str) -> np.ndarray:
        return np.arange(n) if k <= 0 or k >= n else np.sort(numpy_rng(seed, stream).choice(n, k, replace=False))

    tr = pick(len(data.train_labels), max_train, "subsample-train")
    te = pick(len(data.test_labels), max_test, "subsample-test")
    return ImageData(data.train_images[tr], data.train_labels[tr], data.test_images[te], data.test_labels[te],
                     data.label_names)


# -- feature-shift domains ------------------------------------------------------------------------------------
def check_domains(domains: list[str]) -> list[str]:
    domains = [str(d) for d in domains]
    bad = [d for d in domains if d not in DOMAINS]
    if bad or len(set(domains)) != len(domains):
        raise ValueError(f"task.options.domains must be distinct names among {', '.join(DOMAINS)}; got {domains}")
    return domains


def apply_domain(images: torch.Tensor, domain: str, seed: int = 0) -> torch.Tensor:
    """A domain's deterministic shift of images ``[n, C, H, W]`` in ``[0, 1]`` (float), values kept in ``[0, 1]``:

    * ``clean`` — unchanged; ``rotate`` — 90° counter-clockwise; ``contrast`` — contrast × 0.35 about 0.5;
    * ``blur`` — 5×5 Gaussian (σ = 1) per channel, edge-padded; ``noise`` — additive Gaussian, σ = 0.25, one
      fixed draw for the whole array (seeded by ``seed``: apply it once to a stored set); ``invert`` — ``1 − x``.
    """
    if domain == "clean":
        return images
    if domain == "rotate":
        return torch.rot90(images, 1, dims=(-2, -1))
    if domain == "contrast":
        return 0.5 + 0.35 * (images - 0.5)
    if domain == "blur":
        t = torch.arange(5, dtype=images.dtype) - 2
        g = torch.exp(-t ** 2 / 2)
        kernel = (g[:, None] * g[None, :]) / g.sum() ** 2
        c = images.shape[1]
        padded = F.pad(images, (2, 2, 2, 2), mode="replicate")
        return F.conv2d(padded, kernel.expand(c, 1, 5, 5).contiguous(), groups=c)
    if domain == "noise":
        noise = torch.randn(images.shape, generator=torch_generator(seed, "domain-noise"), dtype=images.dtype)
        return (images + 0.25 * noise).clamp(0.0, 1.0)
    if domain == "invert":
        return 1.0 - images
    raise ValueError(f"unknown domain {domain!r}; allowed: {', '.join(DOMAINS)}")


def assign_domains(num_examples: int, num_domains: int, seed: int) -> np.ndarray:
    """``[N]`` domain ids: a seeded permutation cut into ``num_domains`` near-equal groups (each example is seen in
    exactly one domain, as DomainNet's images each belong to one domain)."""
    ids = np.empty(num_examples, dtype=np.int64)
    for d, chunk in enumerate(np.array_split(numpy_rng(seed, "domains").permutation(num_examples), num_domains)):
        ids[chunk] = d
    return ids


__all__ = ["DOMAINS", "FASHION_MNIST_CLASSES", "FASHION_MNIST_DIR", "ImageData", "apply_domain",
           "assign_domains", "check_domains", "fashion_mnist_folder", "load_fashion_mnist", "load_hf_images",
           "load_image_folder", "read_idx", "subsample_images"]
