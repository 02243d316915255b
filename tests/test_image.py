"""Image classification: Fashion-MNIST reader, image folders, preprocessing, feature-shift domains and
their partition, every method on a tiny ViT, resume, export, convolutions as [out, in·kh·kw] targets (SSF on a
ResNet-20), and the project-pretrained stand-in backbone."""

from __future__ import annotations

import gzip
import hashlib
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedlowrank.config import from_dict
from fedlowrank.export import export_run
from fedlowrank.methods import available_methods
from fedlowrank.methods.ssf import SubspaceLinear
from fedlowrank.tasks.partition import PartitionConfig, partition
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks.image import ImageClassification, to_model_input
from fedlowrank.tasks.image_data import (FASHION_MNIST_DIR, ImageData, apply_domain, load_fashion_mnist,
                                         load_image_folder, read_idx)

HAVE_FMNIST = (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").is_file()
needs_fmnist = pytest.mark.skipif(not HAVE_FMNIST, reason="Debian's dataset-fashion-mnist is not installed")
# settings a method requires (SSF and FedSub take plain SGD local steps)
METHOD_SETTINGS = {"ssf": {"optimizer": "sgd", "lr": 0.05}, "fedsub": {"optimizer": "sgd", "lr": 0.05}}


def synthetic_images(n_train: int = 96, n_test: int = 32, classes: int = 3, channels: int = 1, size: int = 28,
                     seed: int = 0) -> ImageData:
    """Class c is a bright horizontal band at rows 8c..8c+5 plus noise: learnable, no download."""
    rng = np.random.default_rng(seed)

    def make(n):
        y = np.arange(n) % classes
        x = rng.integers(0, 60, size=(n, channels, size, size))
        for i, c in enumerate(y):
            x[i, :, 8 * c: 8 * c + 5] += 180
        return x.clip(0, 255).astype(np.uint8), y.astype(np.int64)

    return ImageData(*make(n_train), *make(n_test), [f"band{c}" for c in range(classes)])


_TASKS: dict = {}


def image_task(model: str = "tiny-vit", domains: tuple[str, ...] = (), channels: int = 1) -> ImageClassification:
    key = (model, domains, channels)
    if key not in _TASKS:
        _TASKS[key] = ImageClassification(synthetic_images(channels=channels), model, domains=list(domains) or None,
                                          eval_batch_size=64, source="synthetic bands")
    return _TASKS[key]


def image_config(method: str, rounds: int = 1, clients: int = 4, per_round: int = 2, partition_kind: str = "iid",
                 model: str = "tiny-vit", **method_options):
    return from_dict({
        "run": {"rounds": rounds, "clients_per_round": per_round, "threads": 1, "device": "cpu", "seed": 0},
        "task": {"kind": "image-classification", "model": model},
        "data": {"source": "image-folder"},
        "partition": {"kind": partition_kind, "num_clients": clients, "min_partition_size": 4},
        "lora": {"rank": 2, "alpha": 4.0},
        "train": {"local_steps": 2, "batch_size": 8, "lr": 1e-3, **METHOD_SETTINGS.get(method, {})},
        "method": {"name": method, **method_options}})


# -- data ---------------------------------------------------------------------------------------------------------
@needs_fmnist
def test_fashion_mnist_reader_counts_and_first_image_checksum():
    images = read_idx(FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz")
    labels = read_idx(FASHION_MNIST_DIR / "train-labels-idx1-ubyte.gz")
    assert images.shape == (60000, 28, 28) and images.dtype == np.uint8
    assert np.bincount(labels).tolist() == [6000] * 10
    assert read_idx(FASHION_MNIST_DIR / "t10k-images-idx3-ubyte.gz").shape == (10000, 28, 28)
    assert np.bincount(read_idx(FASHION_MNIST_DIR / "t10k-labels-idx1-ubyte.gz")).tolist() == [1000] * 10
    assert labels[0] == 9  # an ankle boot
    assert hashlib.sha256(images[0].tobytes()).hexdigest() == \
        "5bd44e331a6d6998daf675700cd0c13dcd7af8ab954b7585124124da61459e7b"


@needs_fmnist
def test_fashion_mnist_class_subset_is_relabelled_in_order():
    data = load_fashion_mnist(classes=[5, 6, 7, 8, 9])
    assert data.label_names == ["Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
    assert data.train_images.shape == (30000, 1, 28, 28)
    assert np.bincount(data.train_labels).tolist() == [6000] * 5
    assert np.bincount(data.test_labels).tolist() == [1000] * 5
    assert data.train_labels[0] == 4  # the first training image, class 9, is now label 4
    with pytest.raises(ValueError, match="task.options.classes"):
        load_fashion_mnist(classes=[3, 3])


def test_idx_reader_parses_the_header_and_refuses_a_wrong_size(tmp_path):
    body = np.arange(2 * 3 * 4, dtype=np.uint8)
    good = tmp_path / "x.gz"
    good.write_bytes(gzip.compress(bytes([0, 0, 8, 3]) + b"".join(n.to_bytes(4, "big") for n in (2, 3, 4))
                                   + body.tobytes()))
    assert np.array_equal(read_idx(good), body.reshape(2, 3, 4))
    bad = tmp_path / "y.gz"
    bad.write_bytes(gzip.compress(bytes([0, 0, 8, 1]) + (5).to_bytes(4, "big") + b"abc"))
    with pytest.raises(ValueError, match="header says"):
        read_idx(bad)


def test_image_folder_reads_classes_in_sorted_order_and_splits_stratified(tmp_path):
    from PIL import Image

    for c, value in (("dog", 200), ("cat", 20)):
        (tmp_path / c).mkdir()
        for i in range(5):
            Image.fromarray(np.full((6, 8), value + i, dtype=np.uint8)).save(tmp_path / c / f"{i}.png")
    data = load_image_folder(tmp_path, test_fraction=0.2, seed=0)
    assert data.label_names == ["cat", "dog"]
    assert data.train_images.shape == (8, 1, 6, 8) and data.test_images.shape == (2, 1, 6, 8)
    assert sorted(data.test_labels.tolist()) == [0, 1]
    assert all(img.min() >= 200 for img, y in zip(data.train_images, data.train_labels) if y == 1)


def test_preprocessing_converts_channels_resizes_and_normalises():
    gray = torch.full((2, 1, 14, 14), 255, dtype=torch.uint8)
    x = to_model_input(gray, {"image_size": 28, "num_channels": 3, "mean": [0.5, 0.25, 0.0], "std": [0.5, 0.25, 1.0]})
    assert x.shape == (2, 3, 28, 28)
    assert torch.allclose(x[:, 0], torch.ones(1)) and torch.allclose(x[:, 1], torch.full((1,), 3.0))
    rgb = torch.zeros(1, 3, 28, 28, dtype=torch.uint8)
    rgb[:, 1] = 255
    y = to_model_input(rgb, {"image_size": 28, "num_channels": 1, "mean": [0.0], "std": [1.0]})
    assert y.shape == (1, 1, 28, 28) and torch.allclose(y, torch.full_like(y, 0.587))


def test_domains_are_deterministic_and_keep_the_value_range():
    x = torch.rand(3, 1, 10, 10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(apply_domain(apply_domain(x, "invert"), "invert"), x)
    four = x
    for _ in range(4):
        four = apply_domain(four, "rotate")
    assert torch.equal(four, x) and not torch.equal(apply_domain(x, "rotate"), x)
    flat = torch.full((1, 3, 9, 9), 0.3)
    assert torch.allclose(apply_domain(flat, "blur"), flat)  # a blur keeps a constant image
    low = apply_domain(x, "contrast")
    assert low.std() < 0.5 * x.std() and torch.allclose(low.mean(), 0.5 + 0.35 * (x.mean() - 0.5))
    assert torch.equal(apply_domain(x, "noise", seed=3), apply_domain(x, "noise", seed=3))
    for d in ("rotate", "contrast", "blur", "noise", "invert"):
        y = apply_domain(x, d, seed=1)
        assert y.shape == x.shape and y.min() >= 0 and y.max() <= 1


# -- the domain partition -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("clients", [3, 5, 7])
def test_domain_partition_gives_each_client_one_domain_and_covers_every_example(clients):
    domain_ids = np.repeat(np.arange(3), [40, 41, 39])[np.random.default_rng(1).permutation(120)]
    parts = partition(120, None, PartitionConfig(kind="domains", num_clients=clients), 0, domain_ids)
    assert sorted(np.concatenate(parts).tolist()) == list(range(120))
    for k, p in enumerate(parts):
        assert set(domain_ids[p].tolist()) == {k % 3}
    for d in range(3):  # each domain is shared evenly by its clients
        sizes = [len(p) for k, p in enumerate(parts) if k % 3 == d]
        assert max(sizes) - min(sizes) <= 1
    assert partition(120, None, PartitionConfig(kind="domains", num_clients=clients), 0, domain_ids)[0].tolist() \
        == parts[0].tolist()


def test_domain_partition_refuses_too_few_clients_and_tasks_without_domains():
    with pytest.raises(ValueError, match="fewer than the task's 3 domains"):
        partition(30, None, PartitionConfig(kind="domains", num_clients=2), 0, np.arange(30) % 3)
    with pytest.raises(ValueError, match="task.options.domains"):
        partition(30, np.zeros(30, dtype=np.int64), PartitionConfig(kind="domains", num_clients=2), 0, None)


def test_domain_task_shifts_training_data_reports_clients_and_evaluates_per_domain(tmp_path):
    task = image_task(domains=("clean", "invert", "rotate"))
    plain = image_task()
    inv = np.flatnonzero(task.domain_ids == 1)
    assert np.array_equal(task.train_images[inv].numpy(), 255 - plain.train_images[inv].numpy())
    clean = np.flatnonzero(task.domain_ids == 0)
    assert torch.equal(task.train_images[clean], plain.train_images[clean])
    sim = Simulation(image_config("fedit", clients=6, partition_kind="domains"), task=task, run_dir=tmp_path)
    report = json.loads((tmp_path / "partition.json").read_text())
    assert report["client_domains"] == ["clean", "invert", "rotate"] * 2
    assert all(np.count_nonzero(row) == 1 for row in report["domain_histograms"])
    sim.run()
    metrics = sim.history[-1]
    per = [metrics[f"accuracy_{d}"] for d in ("clean", "invert", "rotate")]
    assert math.isclose(metrics["accuracy"], sum(per) / 3)


# -- every method, resume, export -----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", sorted(available_methods()))
def test_one_round_of_every_method_on_the_tiny_vit(method):
    sim = Simulation(image_config(method), task=image_task())
    sim.run()
    assert len(sim.history) == 1 and math.isfinite(sim.history[-1]["accuracy"])
    assert all(torch.isfinite(v).all() for v in sim.server.tensors().values())
    assert len(sim.ledger.rows) == (2 if not sim.method.pooled else 1)
    assert all((r["up"] > 0 and r["down"] > 0) == sim.method.communicates for r in sim.ledger.rows)


def test_vit_targets_are_the_attention_projections_and_the_head_is_the_classifier():
    model = image_task().build_model()
    assert model.target_names == [f"vit.layers.{i}.attention.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    assert model.head_names == ["classifier.weight", "classifier.bias"]


def test_clip_vision_tower_trains_on_grayscale_images():
    task = image_task(model="tiny-clip")
    assert task.loaded.preprocess["num_channels"] == 3
    assert task.batch(np.arange(4))["pixel_values"].shape == (4, 3, 28, 28)
    model = task.build_model()
    assert all(n.startswith("vision_model.encoder.layers.") for n in model.target_names)
    assert model.head_names == ["classifier.weight", "classifier.bias"]
    sim = Simulation(image_config("fedit", rounds=2, model="tiny-clip"), task=task)
    sim.run()
    assert math.isfinite(sim.history[-1]["loss"])


@pytest.mark.parametrize("method", ["fedit", "ssf"])
def test_resume_on_the_tiny_vit_is_bit_identical(method, tmp_path):
    cfg = image_config(method, rounds=3)
    cfg.run.checkpoint_every = 1
    straight = Simulation(cfg, task=image_task(), run_dir=tmp_path / "a")
    straight.run()
    interrupted = Simulation(cfg, task=image_task(), run_dir=tmp_path / "b")
    interrupted.run_round()
    del interrupted
    resumed = Simulation.resume(tmp_path / "b", task=image_task())
    assert resumed.round == 1
    resumed.run()
    for k, v in straight.server.items():
        assert torch.equal(v, resumed.server[k]) if isinstance(v, torch.Tensor) else v == resumed.server[k], k
    assert [r["accuracy"] for r in straight.history] == [r["accuracy"] for r in resumed.history]


@pytest.mark.parametrize("method,fmt", [("fedit", "peft"), ("fedavg-full", "merged")])
def test_export_round_trip_on_the_tiny_vit(method, fmt, tmp_path):
    cfg = image_config(method, rounds=2)
    cfg.run.checkpoint_every = 1
    cfg.train.lr = 0.02
    Simulation(cfg, task=image_task(), run_dir=tmp_path / "run").run()
    report = export_run(tmp_path / "run", tmp_path / "out", fmt, task=image_task())
    check = report["check"]
    assert check["run"]["accuracy"] == check["exported"]["accuracy"]
    assert math.isclose(check["run"]["loss"], check["exported"]["loss"], rel_tol=1e-5)
    if fmt == "peft":
        assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["modules_to_save"] == ["classifier"]


# -- convolutions: SSF on a ResNet-20 trained from scratch ------------------------------------------------------------
def test_subspace_adapter_on_a_convolution_is_the_projected_kernel_and_gets_the_projected_gradient():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3, stride=2, padding=1, bias=True)
    layer = SubspaceLinear(conv, rank=4)
    assert (layer.out_features, layer.in_features) == (5, 27)
    P = torch.linalg.qr(torch.randn(27, 4))[0].T.contiguous()
    layer.reset(P)
    with torch.no_grad():
        layer.coef.copy_(torch.randn(5, 4))
    x = torch.randn(2, 3, 9, 9)
    kernel = (conv.weight.reshape(5, -1) + layer.coef @ P).reshape(conv.weight.shape)
    assert torch.allclose(layer(x), F.conv2d(x, kernel, conv.bias, 2, 1), atol=1e-5)
    # autograd on Y gives the projected gradient of the flattened kernel: dL/dY = G Pᵀ
    layer(x).square().sum().backward()
    dense = kernel.detach().requires_grad_(True)
    F.conv2d(x, dense, conv.bias, 2, 1).square().sum().backward()
    assert torch.allclose(layer.coef.grad, dense.grad.reshape(5, -1) @ P.T, atol=1e-4)


@pytest.mark.parametrize("method,options", [("ssf", {"ratio": 0.25}), ("fedsub", {}),
                                            ("fedavg-full", {"correction": "scaffold"}), ("fedit", {})])
def test_resnet20_projects_every_convolution(method, options):
    task = image_task(model="resnet20")
    model = task.build_model()
    convs = [n for n, m in model.net.named_modules() if isinstance(m, nn.Conv2d)]
    assert model.target_names == convs and len(convs) == 19
    assert {n.rsplit(".", 1)[0] for n in model.head_names} >= {"classifier", "norm"}
    sim = Simulation(image_config(method, **options, model="resnet20"), task=task)
    sim.run()
    assert math.isfinite(sim.history[-1]["loss"])
    if method == "ssf":  # the global kernels [out, in·3·3] moved inside rank round(0.25·in·9) subspaces
        w = sim.server["w/layers.8.conv2"]
        assert w.shape == (64, 576) and sim.method._ranks["layers.8.conv2"] == 144


# -- the stand-in backbone ---------------------------------------------------------------------------------------------
@needs_fmnist
def test_fmnist_vit_is_pretrained_once_on_the_other_classes_and_says_so(tmp_path, monkeypatch):
    import fedlowrank.tasks.fmnist_vit as models

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setitem(models.FMNIST_VIT, "steps", 2)
    monkeypatch.setitem(models.FMNIST_VIT, "num_hidden_layers", 1)
    data = load_fashion_mnist(classes=[5, 6, 7, 8, 9])
    small = ImageData(data.train_images[:40], data.train_labels[:40], data.test_images[:20], data.test_labels[:20],
                      data.label_names)
    task = ImageClassification(small, "fmnist-vit")
    folder = tmp_path / "fedlowrank" / "fmnist-vit-v1"
    record = json.loads((folder / "pretraining.json").read_text())
    assert record["pretraining_classes"] == [0, 1, 2, 3, 4] and "not ImageNet-pretrained" in record["note"]
    assert "not ImageNet-pretrained" in task.describe()["backbone"]
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    again = ImageClassification(small, "fmnist-vit")  # cached: not rebuilt, same weights
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
    a, b = task.build_model().net, again.build_model().net
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    from safetensors.torch import load_file

    # the backbone is the pretrained one, not re-initialised (transformers renames the keys on loading)
    saved, loaded = load_file(str(folder / "model.safetensors")), list(a.state_dict().values())
    assert len(saved) == len(loaded) - 2  # all but the new classifier's weight and bias
    assert all(any(v.shape == w.shape and torch.equal(v, w) for w in loaded) for v in saved.values())


# -- Flower -----------------------------------------------------------------------------------------------------------
def test_flower_runs_the_image_task_like_the_simulator(tmp_path, monkeypatch):
    pytest.importorskip("flwr")
    from flwr.supercore.task_identity import TaskIdentity
    from test_flower import LoopGrid, assert_same_state

    import fedlowrank.runtime.run as run_module
    import fedlowrank.runtime.simulator as simulator
    from fedlowrank.runtime.flower import client_app
    from fedlowrank.runtime.flower.settings import load_run_config
    from fedlowrank.runtime.flower.strategy import MethodStrategy, state_arrays

    for name in ("run_id", "node_id", "task_id"):  # this process plays SuperLink and SuperNodes (test_flower.py)
        monkeypatch.setattr(TaskIdentity, f"_{name}", 7)
    task = image_task(domains=("clean", "invert"))
    monkeypatch.setattr(run_module, "build_task", lambda cfg, cohorts=False: task)
    client_app._runs.clear()
    (tmp_path / "image.toml").write_text(
        '[run]\nrounds = 2\nclients_per_round = 2\nthreads = 1\ndevice = "cpu"\n'
        '[task]\nkind = "image-classification"\nmodel = "tiny-vit"\n'
        'options = { domains = ["clean", "invert"] }\n[data]\nsource = "image-folder"\n'
        '[partition]\nkind = "domains"\nnum_clients = 4\n[lora]\nrank = 2\nalpha = 4.0\n'
        '[train]\nlocal_steps = 2\nbatch_size = 8\n[method]\nname = "fedit"\n')
    run_config = {"config": str(tmp_path / "image.toml"), "set": "", "flower.node-timeout": 0.0}
    cfg, settings = load_run_config(run_config)
    sim = simulator.Simulation(cfg, task=task)
    strategy = MethodStrategy(sim, settings)
    grid = LoopGrid(run_config, cfg.partition.num_clients)
    strategy.connect(grid)
    strategy.start(grid, state_arrays(sim.server), num_rounds=cfg.run.rounds, timeout=1.0,
                   evaluate_fn=strategy.evaluate)
    ref = simulator.Simulation(cfg, task=task)
    ref.run()
    client_app._runs.clear()
    assert_same_state(sim.server, ref.server)
    assert [r.get("accuracy_invert") for r in sim.history] == [r.get("accuracy_invert") for r in ref.history]
    assert isinstance(sim.history[-1]["accuracy_invert"], float)


def test_a_convolution_target_exports_to_peft_and_merged_exactly(tmp_path):
    """The ViT's patch-embedding convolution as a LoRA target: PEFT's LoRA-for-Conv2d factors are ours reshaped."""
    task = ImageClassification(synthetic_images(), "tiny-vit", targets=["q_proj", "projection"])
    assert "vit.embeddings.patch_embeddings.projection" in task.build_model().target_names
    for method, fmt in (("fedit", "peft"), ("ssf", "merged")):
        cfg = image_config(method, rounds=2)
        cfg.run.checkpoint_every = 1
        cfg.lora.targets = ["q_proj", "projection"]
        Simulation(cfg, task=task, run_dir=tmp_path / method).run()
        check = export_run(tmp_path / method, tmp_path / f"out-{method}", fmt, task=task)["check"]
        assert check["run"]["accuracy"] == check["exported"]["accuracy"]
        assert math.isclose(check["run"]["loss"], check["exported"]["loss"], rel_tol=1e-5)


def test_compare_and_tune_score_an_image_task_by_accuracy(tmp_path):
    """``fedlowrank compare`` / ``tune`` on an image folder: accuracy is the metric (it was ``rel_error``, an error)."""
    from PIL import Image

    from fedlowrank.cli import main

    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (tmp_path / "img" / c).mkdir(parents=True)
        for i in range(12):
            Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8)).save(tmp_path / "img" / c / f"{i}.png")
    sets = ["task.kind=image-classification", "task.model=tiny-vit", "data.source=image-folder",
            f"data.train={tmp_path / 'img'}", "run.rounds=1", "run.clients_per_round=2", "partition.kind=iid",
            "partition.num_clients=2", "lora.rank=2", "train.batch_size=4", "train.local_steps=1"]
    args = [x for s in sets for x in ("--set", s)]
    assert main(["compare", "tiny", "--methods", "fedit,ffa-lora", "--seeds", "0", "--out", str(tmp_path / "c"),
                 "--quiet", *args]) == 0
    res = json.loads((tmp_path / "c" / "results.json").read_text())
    assert res["metric"] == "accuracy" and res["higher_is_better"]
    assert main(["tune", "tiny", "--methods", "fedit", "--grid", "1e-3,1e-2", "--out", str(tmp_path / "t"), "--quiet",
                 *args]) == 0
    assert json.loads((tmp_path / "t" / "tune.json").read_text())["setup"]["metric"] == "accuracy"
