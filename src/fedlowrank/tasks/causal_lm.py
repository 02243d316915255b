"""Instruction tuning of a causal language model (``task.kind = "causal-lm"``), e.g. SmolLM2 on GSM8K.

* **Formatting**: the prompt is the user turn of the model's chat template (with the generation prompt) when its
  tokenizer has one, else the plain template ``"Question: {prompt}\\nAnswer: "``; the response follows as
  ``tokens(response) + [eos]``. The loss is on the response tokens only: prompt and padding labels are -100.
* **Truncation** at ``task.max_length`` tokens keeps the start; the examples cut, and those whose response was
  cut entirely (no loss tokens left), are counted in :meth:`CausalLM.describe` and logged.
* **Batches** are padded on the right to the batch's longest example (dynamic padding), or to the smallest of
  ``task.length_buckets`` that holds it (a few static shapes, for compiled steps); with ``pack`` a step's examples
  (a cohort's: all its members') are packed into rows of that many tokens, positions restarting at each example
  (:func:`pack`), which removes most padding.
* **Loss without full logits**: the network's last hidden states are gathered at the positions whose next token
  is a response token, and only those go through the language-model head, in chunks, with the cross-entropy
  accumulated in fp32 (:func:`response_nll`): memory ∝ response tokens × hidden, never batch × length ×
  vocabulary. The positions are found on the host from the labels, and staged on the device with the token ids
  before the step (:meth:`CausalLM.device_batch`): a step neither moves a tensor nor waits for the device.
* **Evaluation**: token loss and perplexity on the responses of a fixed seeded subset of the test split
  (``eval_examples``), and, when ``eval_generate`` > 0, the exact match of the final number of greedy generations
  (batched with left padding and the KV cache, ``max_new_tokens``, stopping at EOS) on a fixed seeded subset of
  that many questions; the first ``write_generations`` of them are handed to the runtime for the run directory.
"""

from __future__ import annotations

import logging
import math
import re
import weakref
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..adapters.model import AdaptedModel, Routing
from ..device import module_device, stage
from ..models.architectures import SPEED_AND_MEMORY_ONLY
from ..schema import Schema, setting
from ..seeding import numpy_rng
from . import register_task
from .base import Task, adapted_copy, check_max_length, join_padded, padded_length
from .instructions import INSTRUCTION_SOURCES, InstructionData

log = logging.getLogger("fedlowrank")

PLAIN_TEMPLATE = "Question: {prompt}\nAnswer: "
IGNORE = -100  # label of a token that carries no loss

# A number: optional minus (not after a word character, so "3-5" ends in 5), digits with optional thousands
# commas, optional decimals.
_NUMBER = re.compile(r"(?<![\w.,])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def normalize_number(text: str) -> str | None:
    """``"1,234"`` → ``"1234"``, ``"3.50"`` → ``"3.5"``, ``"-0"`` → ``"0"``; ``None`` if ``text`` is no number."""
    try:
        value = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The final number of a solution, normalised (:func:`normalize_number`): the first number after the last
    ``####`` when there is one (GSM8K's reference format), else the last number in the text; ``None`` if none."""
    if "####" in text:
        found = _NUMBER.findall(text.rsplit("####", 1)[1])
        return normalize_number(found[0]) if found else None
    found = _NUMBER.findall(text)
    return normalize_number(found[-1]) if found else None


@dataclass
class Encoded:
    """One tokenised example: ``ids`` (prompt then response + eos, at most ``max_length``), the prompt's length
    within ``ids``, whether it was truncated and whether its whole response was cut."""

    ids: list[int]
    prompt_len: int
    truncated: bool

    @property
    def lost_response(self) -> bool:
        return self.prompt_len >= len(self.ids)


def uses_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The tokens of the prompt: the chat template's user turn plus the assistant's generation prompt, or the
    plain template (with the tokenizer's own special tokens, e.g. BOS)."""
    if uses_chat_template(tokenizer):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(PLAIN_TEMPLATE.format(prompt=prompt))["input_ids"])


def encode_example(tokenizer, prompt: str, response: str, max_length: int) -> Encoded:
    """Prompt tokens, then ``tokens(response) + [eos]``, cut to ``max_length``."""
    p = prompt_ids(tokenizer, prompt)
    r = list(tokenizer(response, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
    ids = p + r
    return Encoded(ids[:max_length], min(len(p), max_length), len(ids) > max_length)


def collate(examples: list[Encoded], pad_id: int, width: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded batch: ``input_ids``, ``attention_mask`` and ``labels`` (-100 on prompt and padding), each
    ``[B, T]`` with T the longest example, or ``width`` when given (a length bucket)."""
    width = width or max(len(e.ids) for e in examples)
    rows = [(e.ids, len(e.ids), width - len(e.ids), e.prompt_len) for e in examples]
    return {"input_ids": torch.tensor([ids + [pad_id] * pad for ids, _, pad, _ in rows]),
            "attention_mask": torch.tensor([[1] * n + [0] * pad for _, n, pad, _ in rows]),
            "labels": torch.tensor([[IGNORE] * p + ids[p:] + [IGNORE] * pad for ids, _, pad, p in rows])}


DRAWS = 64  # seeded draws of a step's examples that set the rows of a packed shape (PackShapes)


def pack(groups: list[list[Encoded]], capacity: int, pad_id: int, buckets: list[int],
         shapes: "PackShapes | None" = None) -> tuple[dict, torch.Tensor]:
    """The examples of every group (a cohort member's batch, or one client's) in rows of at most ``capacity``
    tokens, each example's positions starting at 0 (so that attention stays within it): ``input_ids``,
    ``position_ids`` and ``labels`` ``[R, W]``, W the fullest row's length or its bucket (:func:`padded_length`;
    padding restarts its positions too), and each token's group ``[R, W]`` (-1: padding). The rows are those of
    :func:`pack_rows`; with ``shapes``, ``[R, W]`` is one of its static shapes (:meth:`PackShapes.layout`), the
    rows past the examples' all padding."""
    items = [(e, g) for g, group in enumerate(groups) for e in group]
    lengths = [len(e.ids) for e, _ in items]
    if shapes is None:
        rows = pack_rows(lengths, capacity)
        width = padded_length(max(sum(lengths[i] for i in row) for row in rows), buckets, capacity)
    else:
        rows, width, count = shapes.layout(lengths)
        rows = rows + [[] for _ in range(count - len(rows))]
    fill = [sum(lengths[i] for i in row) for row in rows]
    ids, positions, labels, members = [], [], [], []
    for row, f in zip(rows, fill):
        pad, row = width - f, [items[i] for i in row]
        ids.append([t for e, _ in row for t in e.ids] + [pad_id] * pad)
        positions.append([p for e, _ in row for p in range(len(e.ids))] + list(range(pad)))
        labels.append([t for e, _ in row for t in [IGNORE] * e.prompt_len + e.ids[e.prompt_len:]] + [IGNORE] * pad)
        members.append([g for e, g in row for _ in e.ids] + [-1] * pad)
    batch = {"input_ids": torch.tensor(ids), "position_ids": torch.tensor(positions), "labels": torch.tensor(labels)}
    return batch, torch.tensor(members)


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Items of ``lengths`` (each ≤ ``capacity``) in rows of at most ``capacity``, as indices, with the fewer
    padded tokens (rows × fullest row) of two layouts, longest items first: first fit (each into the first row
    with room; best for many items) and balanced (the fewest rows that hold them, each item into the least
    filled; best for a few)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    first: list[list[int]] = []
    fill: list[int] = []
    for i in order:
        r = next((r for r, f in enumerate(fill) if f + lengths[i] <= capacity), len(first))
        if r == len(first):
            first.append([])
            fill.append(0)
        first[r].append(i)
        fill[r] += lengths[i]
    layouts = [(len(first) * max(fill), first)]
    count = -(-sum(lengths) // capacity)
    while count <= len(first):
        balanced: list[list[int]] = [[] for _ in range(count)]
        load = [0] * count
        for i in order:
            r = load.index(min(load))
            balanced[r].append(i)
            load[r] += lengths[i]
        if max(load) <= capacity:
            layouts.append((count * max(load), balanced))
            break
        count += 1
    return min(layouts, key=lambda layout: layout[0])[1]


@dataclass
class PackShapes:
    """Static shapes ``[R, W]`` of packed steps (``task.length_buckets`` with ``pack``), so that a compiled step
    compiles once per shape for the whole run. For a step of E examples (a cohort's: all its members'):

    * each width W of ``buckets`` below ``capacity`` that holds the longest training example, and ``capacity``,
      holds R rows: the most that :func:`pack_rows` needed for :data:`DRAWS` seeded draws of E training examples
      (steps like the run's, drawn before it);
    * the last shape, W = ``capacity``, holds the rows that the E longest training examples fill
      (:func:`pack_rows`), which holds any E examples (:meth:`layout`).

    A step takes the shape of fewest tokens that holds it; shapes of as many tokens as the last are dropped.
    Padding rows carry no loss (labels -100, member -1)."""

    capacity: int
    buckets: list[int]
    lengths: list[int]  # the training examples' lengths
    _shapes: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, lengths: list[int], capacity: int, buckets: list[int]) -> "PackShapes":
        return cls(capacity, [b for b in buckets if b < capacity], list(lengths))

    def bound(self, examples: int) -> list[list[int]]:
        """The rows of the ``examples`` longest training examples (index i: the i-th longest)."""
        return pack_rows(sorted(self.lengths, reverse=True)[:examples], self.capacity)

    def shapes(self, examples: int) -> list[tuple[int, int]]:
        """``[(R, W)]`` of a step of ``examples`` examples, fewest tokens first, the bound last."""
        if examples not in self._shapes:
            last = (len(self.bound(examples)), self.capacity)
            rng = numpy_rng(0, "pack-shapes")
            draws = [[self.lengths[i] for i in rng.choice(len(self.lengths), examples)] for _ in range(DRAWS)]
            planned = [(max(len(pack_rows(d, w)) for d in draws), w) for w in [*self.buckets, self.capacity]
                       if w >= max(self.lengths)]
            fewer = [s for s in planned if s[0] * s[1] < last[0] * last[1]]
            self._shapes[examples] = sorted(fewer, key=lambda s: s[0] * s[1]) + [last]
        return self._shapes[examples]

    def layout(self, lengths: list[int]) -> tuple[list[list[int]], int, int]:
        """``(rows, W, R)``: the items of ``lengths`` (indices) in at most R rows of W tokens, the first shape
        of :meth:`shapes` that holds them. The last always does: the i-th longest item is no longer than the i-th
        longest training example, so it may take that example's place in :meth:`bound`'s rows."""
        shapes = self.shapes(len(lengths))
        for count, width in shapes[:-1]:
            if max(lengths) <= width:
                rows = pack_rows(lengths, width)
                if len(rows) <= count:
                    return rows, width, count
        rows, bound = pack_rows(lengths, self.capacity), self.bound(len(lengths))
        if len(rows) > len(bound):
            rank = sorted(range(len(lengths)), key=lambda i: -lengths[i])
            rows = [[rank[j] for j in row] for row in bound]
        return rows, self.capacity, len(bound)

    def member_tokens(self, examples: int) -> int:
        """The most tokens a member of ``examples`` examples packs: its routing's fixed width."""
        return sum(sorted(self.lengths, reverse=True)[:examples])


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, T] ids, [B, T] mask)`` padded on the left (for generation)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask


LOGITS_CHUNK_ELEMENTS = 2**26  # fp32 logits computed at once by response_nll (256 MiB)


@dataclass
class LMHead:
    """What turns a last hidden state ``[.., H]`` into logits ``[.., V]``: ``softcap·tanh(scale·module(h)/softcap)``
    (``softcap`` None: no capping), ``module`` the network's output embeddings (``lm_head``)."""

    module: nn.Module
    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, net: nn.Module) -> "LMHead":
        """The head of a ``*ForCausalLM`` (or a peft model of one): its output embeddings and the config's logit
        scaling (``logit_scale``, ``1/logits_scaling``) and soft-capping (``final_logit_softcapping``)."""
        config = net.config
        scale = float(getattr(config, "logit_scale", None) or 1.0) / float(getattr(config, "logits_scaling", None)
                                                                           or 1.0)
        return cls(net.get_output_embeddings(), scale, getattr(config, "final_logit_softcapping", None))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, V]`` of ``hidden: [n, H]``, at least fp32 (the head's product in its own dtype)."""
        z = self.module(hidden)
        z = z.to(torch.promote_types(z.dtype, torch.float32))
        if self.scale != 1.0:
            z = z * self.scale
        return z if self.softcap is None else self.softcap * torch.tanh(z / self.softcap)


class StepOutput(nn.Module):
    """:meth:`CausalLM.output` of a staged batch (:meth:`CausalLM.device_batch`) on ``net`` as a module, so that
    ``run.compile`` compiles the decoder, the head at the response positions and the cross-entropy as one graph;
    it holds ``net`` weakly (the task keeps one per network: :meth:`CausalLM.compiled_module`)."""

    def __init__(self, task: "CausalLM", net: nn.Module):
        super().__init__()
        self._task, self._net = task, weakref.ref(net)

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        return self._task.staged_output(self._net(), batch, batch["response_at"], batch["response_tokens"])


class _ResponseNLL(torch.autograd.Function):
    """Per-row cross-entropy of ``head.logits(hidden)`` against ``targets``, ``rows`` at a time, so that no chunk's
    logits outlive it. When ``hidden`` needs a gradient, each chunk's ``∂nll/∂hidden`` is computed right after its
    forward in closed form, ``(softmax(z) − onehot(target)) · ∂z/∂h`` with ``z`` the capped, scaled logits
    (:class:`LMHead`: ``∂z/∂h = (1 − (z/cap)²)·scale·W``), no autograd call inside, so that a compiled step traces
    it whole; backward only scales these rows by the incoming gradient. A target :data:`IGNORE` gives 0 and no
    gradient (a fixed-size batch's padding positions). The head gets no gradient."""

    @staticmethod
    def forward(ctx, hidden, targets, head: LMHead, rows: int):
        needs = ctx.needs_input_grad[0]
        nll = [hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))]  # none: no positions
        grads = [hidden.new_zeros(0, hidden.shape[1])]
        for start in range(0, len(hidden), rows):
            h, t = hidden[start:start + rows], targets[start:start + rows]
            z = head.logits(h)                                                       # [n, V], at least fp32
            nll.append(F.cross_entropy(z, t, reduction="none", ignore_index=IGNORE))
            if needs:
                dz = torch.softmax(z, -1)
                dz.scatter_add_(1, t.clamp_min(0)[:, None], torch.full_like(t, -1, dtype=dz.dtype)[:, None])
                dz = dz * (t != IGNORE).to(dz.dtype)[:, None]
                if head.softcap is not None:
                    dz = dz * (1 - (z / head.softcap) ** 2)
                if head.scale != 1.0:
                    dz = dz * head.scale
                grads.append(dz.to(head.module.weight.dtype) @ head.module.weight)
        ctx.save_for_backward(torch.cat(grads).to(hidden.dtype) if needs else None)
        return torch.cat(nll)

    @staticmethod
    def backward(ctx, grad_nll):
        (grad,) = ctx.saved_tensors
        return grad * grad_nll[:, None].to(grad.dtype), None, None, None


def response_nll(hidden: torch.Tensor, targets: torch.Tensor, head: LMHead, rows: int | None = None) -> torch.Tensor:
    """Next-token negative log-likelihoods ``[N]`` (at least fp32) of ``targets: [N]`` from the last hidden states that
    predict them, ``hidden: [N, H]``, through ``head``, ``rows`` at a time (default: as many as make
    :data:`LOGITS_CHUNK_ELEMENTS` logits). The head's parameters never get a gradient (in training they must not
    require one; an evaluation without autograd may run any model, e.g. an export loaded back)."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in head.module.parameters()):
        raise ValueError("response_nll: the language-model head is frozen in causal-LM tuning; its parameters "
                         "must not require a gradient")
    rows = rows or max(1, LOGITS_CHUNK_ELEMENTS // head.module.weight.shape[0])
    return _ResponseNLL.apply(hidden, targets, head, rows)


def check_pack_option(value, key: str) -> None:
    """``task.options.pack`` is ``"auto"`` or an integer ≥ 0."""
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{key} must be auto or an integer >= 0, got {value!r}")


def check_pack(pack: int, max_length: int) -> None:
    """``task.options.pack`` is 0 or holds a whole example (at least ``task.max_length`` tokens)."""
    if pack and pack < max_length:
        raise ValueError(f"task.options.pack must be 0 or at least task.max_length = {max_length} (a row holds "
                         f"whole examples), got {pack}")


@torch.no_grad()
def keeps_packed_sequences_apart(net: nn.Module) -> bool:
    """Whether the decoder keeps two sequences packed in one row apart (positions restarting at 0, no attention
    mask: transformers' packed-sequence masks)."""
    decoder, vocab = net.get_decoder(), net.get_input_embeddings().num_embeddings
    a, b = torch.arange(3, 8)[None] % vocab, torch.arange(11, 15)[None] % vocab
    alone = torch.cat([decoder(input_ids=x, use_cache=False).last_hidden_state for x in (a, b)], 1)
    packed = decoder(input_ids=torch.cat([a, b], 1), position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]]),
                     use_cache=False).last_hidden_state
    return torch.allclose(packed, alone, rtol=1e-4, atol=1e-4 * float(alone.abs().max()))


def check_packing(net: nn.Module, spec: str) -> None:
    """:func:`keeps_packed_sequences_apart`, or one line naming ``task.model``."""
    if not keeps_packed_sequences_apart(net):
        raise ValueError(f"task.model = {spec!r}: its attention does not keep sequences packed in one row apart "
                         f"(positions restarting at 0); set task.options.pack = 0")


@torch.no_grad()
def check_lm_head(net: nn.Module, spec: str) -> None:
    """That :class:`LMHead` gives the network's own logits (on 8 tokens), or one line naming ``task.model``: the
    response-only loss computes logits from the decoder's last hidden state itself."""
    ids = torch.arange(3, 11)[None] % net.get_input_embeddings().num_embeddings
    full = net(input_ids=ids).logits[0].float()
    ours = LMHead.of(net).logits(net.get_decoder()(input_ids=ids).last_hidden_state[0])
    if not torch.allclose(ours, full, rtol=1e-4, atol=1e-4 * float(full.abs().max())):
        raise ValueError(f"task.model = {spec!r}: its logits are not its output embeddings of the decoder's last "
                         f"hidden state (scaled by logit_scale or 1/logits_scaling, soft-capped by "
                         f"final_logit_softcapping), which the response-only loss computes; this architecture is "
                         f"not supported by task.kind = 'causal-lm'")


def response_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where a batch's loss is, from its labels ``[B, T]`` (on the host, before the step: a device's labels would
    make the host wait): the flat indices ``b·T + t`` ``[N]`` of the positions t whose next token is a response
    token, those tokens ``[N]`` and their rows b ``[N]``."""
    target = labels[:, 1:]
    rows, cols = (target != IGNORE).nonzero(as_tuple=True)
    return rows * labels.shape[1] + cols, target[rows, cols], rows


@torch.no_grad()
def generate(net: nn.Module, tokenizer, prompts: list[list[int]], max_new_tokens: int,
             batch_size: int = 8) -> list[list[int]]:
    """Greedy continuations of tokenised prompts: batches of ``batch_size``, left padding, the KV cache, at most
    ``max_new_tokens`` each, cut at (and without) the first EOS."""
    net.eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        ids, mask = left_pad(prompts[start:start + batch_size], pad)
        dev = module_device(net)
        seq = net.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens,
                           do_sample=False, use_cache=True, eos_token_id=eos, pad_token_id=pad,
                           temperature=None, top_p=None, top_k=None)
        for row in seq[:, ids.shape[1]:].tolist():
            out.append(row[:row.index(eos)] if eos in row else row)
    return out


MAX_NEW_TOKENS = 1 << 17


@dataclass
class CausalLMOptions(Schema):
    """``task.options`` of ``task.kind = "causal-lm"``: what is evaluated, on which fixed subsets."""

    prefix = "task.options"

    eval_examples: int = setting(200, "size of the fixed test subset for loss and perplexity (0 = the whole test "
                                 "split)", ge=0)
    eval_generate: int = setting(0, "questions in the fixed generation subset for exact match (0 = no generation)",
                                 ge=0)
    max_new_tokens: int = setting(256, "generation budget per question", ge=1, le=MAX_NEW_TOKENS,
                                  reason="longer than any bundled model's context")
    generation_batch_size: int = setting(8, "questions generated together", ge=1)
    write_generations: int = setting(5, "generations per evaluation written to the run directory", ge=0)
    eval_seed: int = setting(0, "seed of the two evaluation subsets (fixed across runs and methods unless changed)")
    pack: int | str = setting("auto", "the length of the rows into which a step's examples are packed (a cohort's: "
                              "all its members', each token routed to its own member's adapters), which removes most "
                              "padding: at least task.max_length (768 suits GSM8K), 0 = no packing, or auto = packed "
                              "when the run trains cohorts and packing is correct (no privacy.dpsgd, a method that "
                              "reads no per-example features, a model that keeps packed sequences apart), in rows "
                              "of 2 × task.max_length (each holds two whole examples at least)", check=check_pack_option,
                              form="auto or an integer >= 0")


@register_task
class CausalLM(Task):
    """Causal-LM instruction tuning; metrics ``loss`` and ``perplexity`` (held-out response tokens) and, with
    ``eval_generate`` > 0, ``exact_match`` of the final number.

    Args:
        data: the prompt/response pairs.
        model: ``task.model``: a bundled name (``smollm2-135m``, ``tiny-llama``...), a local folder or a hub id.
        max_length: tokens per training example (prompt + response + eos); longer examples are cut.
        targets: LoRA target modules (``lora.targets``); ``None`` = the architecture's default.
        eval_batch_size: examples per evaluation forward pass.
        eval_examples, eval_generate, max_new_tokens, generation_batch_size, write_generations, eval_seed, pack: the
            options (``task.options``), declared with their meanings and bounds in :class:`CausalLMOptions`.
        quantize: ``task.quantize``: ``""``, or ``"4bit"``/``"8bit"`` storage of the frozen backbone (QLoRA).
        length_buckets: ``task.length_buckets``: training batches are padded to the smallest that holds them.
    """

    name = "causal-lm"
    metrics = ("loss", "perplexity", "exact_match")
    primary_metric = "loss"
    maximize = ("exact_match",)
    supports_cohorts = True
    supports_quantize = True
    Options = CausalLMOptions
    data_description = "instruction data"
    data_sources = INSTRUCTION_SOURCES  # every registered instruction data set (instructions.py)

    @classmethod
    def check_config(cls, cfg) -> None:
        """``task.options.pack`` holds whole examples (≥ ``task.max_length``) and is refused with DP-SGD."""
        pack = cfg.task.options.get("pack", "auto")
        if pack == "auto":
            return
        check_pack(pack, cfg.task.max_length)
        if pack and cfg.privacy.dpsgd:
            raise ValueError("task.options.pack with privacy.dpsgd: DP-SGD clips each example's gradient, and a "
                             "packed row holds several examples; set task.options.pack = 0")

    @classmethod
    def from_config(cls, cfg, cohorts: bool = False) -> "CausalLM":
        """Read the instruction data of ``[data]`` (with ``partition.partition_by``'s column) and tokenise it;
        ``task.options.pack = auto`` packs when the run trains ``cohorts`` whose examples may be packed together
        (:func:`fedlowrank.runtime.plan.packs_cohorts`)."""
        from .instructions import load_instructions

        data = load_instructions(cfg.data, cfg.partition.partition_by, cfg.run.seed)
        options = dict(cfg.task.options)
        if options.get("pack", "auto") == "auto":
            options["pack"] = "auto" if cohorts else 0
        return cls(data, cfg.task.model, cfg.task.max_length, cfg.lora.targets or None, cfg.task.eval_batch_size,
                   quantize=cfg.task.quantize, length_buckets=cfg.task.length_buckets, **options)

    def __init__(self, data: InstructionData, model: str = "tiny-llama", max_length: int = 256,
                 targets: list[str] | None = None, eval_batch_size: int = 8,
                 eval_examples: int = CausalLMOptions.eval_examples,
                 eval_generate: int = CausalLMOptions.eval_generate,
                 max_new_tokens: int = CausalLMOptions.max_new_tokens,
                 generation_batch_size: int = CausalLMOptions.generation_batch_size,
                 write_generations: int = CausalLMOptions.write_generations,
                 eval_seed: int = CausalLMOptions.eval_seed, pack: int | str = 0,
                 quantize: str = "", length_buckets: list[int] | None = None):
        from ..models.loading import load_model

        CausalLMOptions(eval_examples=eval_examples, eval_generate=eval_generate, max_new_tokens=max_new_tokens,
                        generation_batch_size=generation_batch_size, write_generations=write_generations,
                        eval_seed=eval_seed, pack=pack)  # checks each option
        self.loaded = load_model(model, "causal-lm", quantize=quantize)
        if pack == "auto":  # rows of two whole examples at least, when the model keeps packed sequences apart
            pack = 2 * max_length if keeps_packed_sequences_apart(self.loaded.net) else 0
        check_pack(pack, max_length)
        self.data = data
        self.model_name = model
        self.max_length = max_length
        self.length_buckets = list(length_buckets or [])
        self.pack = pack
        self.targets = targets
        self.eval_batch_size = eval_batch_size
        self.max_new_tokens = max_new_tokens
        self.generation_batch_size = generation_batch_size
        self.write_generations = write_generations
        check_max_length(self.loaded, max_length)
        check_lm_head(self.loaded.net, model)
        if pack:
            check_packing(self.loaded.net, model)
        self.tokenizer = self.loaded.tokenizer
        tok = self.tokenizer
        self.train = [encode_example(tok, p, r, max_length) for p, r in zip(data.train_prompts, data.train_responses)]
        self.shapes = (PackShapes.of([len(e.ids) for e in self.train], pack, self.length_buckets)
                       if pack and self.length_buckets else None)
        counts = sorted((max(len(e.ids) - max(e.prompt_len, 1), 0) for e in self.train), reverse=True)
        self.response_counts = np.concatenate([[0], np.cumsum(counts)])  # [i]: the i examples with most positions
        self._outputs: "weakref.WeakKeyDictionary[nn.Module, StepOutput]" = weakref.WeakKeyDictionary()
        n_test = len(data.test_prompts)
        pick = numpy_rng(eval_seed, "eval-loss-subset").permutation(n_test)
        self.eval_idx = np.sort(pick[:eval_examples] if eval_examples else pick)
        evals = [encode_example(tok, data.test_prompts[i], data.test_responses[i], max_length) for i in self.eval_idx]
        order = np.argsort([len(e.ids) for e in evals], kind="stable")  # length-sorted: less padding
        self.eval_encoded = [evals[i] for i in order]
        self.eval_order = self.eval_idx[order]  # the test index of each of eval_encoded
        numeric = [i for i in range(n_test) if extract_answer(data.test_responses[i]) is not None]
        pick = numpy_rng(eval_seed, "eval-generate-subset").permutation(len(numeric))[:eval_generate]
        self.generate_idx = np.sort(np.asarray(numeric, dtype=np.int64)[pick]) if eval_generate else np.zeros(0, int)
        self.metric_counts = {"exact_match": len(self.generate_idx)}
        if eval_generate and not numeric:
            raise ValueError("task.options.eval_generate: no test response has a final number to match "
                             "(GSM8K-style '#### N' or a last number); set eval_generate = 0")
        self.generation_prompts = [prompt_ids(tok, data.test_prompts[i])[-max_length:] for i in self.generate_idx]
        self._generations: list[dict[str, Any]] = []
        self._said_speed_only = False
        self.truncation = {split: {"examples": len(enc), "truncated": sum(e.truncated for e in enc),
                                   "lost_response": sum(e.lost_response for e in enc)}
                           for split, enc in (("train", self.train), ("eval", evals))}
        t = self.truncation["train"]
        if t["truncated"]:
            log.warning("causal-lm: %d of %d training examples are longer than task.max_length = %d tokens and were "
                        "truncated; %d of them lost their whole response", t["truncated"], t["examples"],
                        max_length, t["lost_response"])

    @property
    def num_train(self) -> int:
        return len(self.train)

    def column_values(self, name: str) -> list[str]:
        if name not in self.data.train_columns:
            raise ValueError(f"partition.partition_by = {name!r}: the data was read without that column")
        return self.data.train_columns[name]

    def test_column(self, name: str) -> list[str] | None:
        return self.data.test_columns.get(name)

    def embedding_texts(self) -> list[str]:
        return self.data.train_prompts

    def build_model(self) -> AdaptedModel:
        """A copy of the loaded model; no head is trained (``lm_head`` and the embeddings stay frozen)."""
        return adapted_copy(self.loaded, self.targets, train_outputs=False)

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """The examples at ``indices``, padded to the longest or to its length bucket (:func:`padded_length`), or
        packed (``pack``: rows of that many tokens, :func:`pack`, with ``example_index`` ``[n]``; with length
        buckets in a static shape, :class:`PackShapes`)."""
        examples = [self.train[int(i)] for i in indices]
        if self.pack:
            batch, _ = pack([examples], self.pack, self.tokenizer.pad_token_id, self.length_buckets, self.shapes)
            return {**batch, "example_index": torch.as_tensor(np.asarray(indices), dtype=torch.long)}
        width = padded_length(max(len(e.ids) for e in examples), self.length_buckets, self.max_length)
        return collate(examples, self.tokenizer.pad_token_id, width)

    def probe_batch(self, rows: int) -> dict[str, torch.Tensor]:
        """``rows`` rows of the longest training example, padded as the longest training batch would be (packed:
        rows of ``pack`` tokens holding as many copies as fit). A padded batch has at least one padded position,
        as any batch of examples of different lengths does: with none, attention takes its mask-free causal path,
        which allocates less than real batches do."""
        longest = max(range(len(self.train)), key=lambda i: len(self.train[i].ids))
        if self.pack:
            return self.batch(np.full(rows * max(1, self.pack // len(self.train[longest].ids)), longest))
        width = padded_length(min(len(self.train[longest].ids) + 1, self.max_length), self.length_buckets,
                              self.max_length)
        return collate([self.train[longest]] * rows, self.tokenizer.pad_token_id, width)

    def rows_per_step(self, batch_size: int) -> float:
        """Rows of a client's training batch at most: ``batch_size``, or the packed rows its longest examples
        fill (as many whole ones as a row holds: :meth:`probe_batch`'s rows)."""
        longest = max(len(e.ids) for e in self.train)
        return batch_size / max(1, self.pack // longest) if self.pack else batch_size

    def probe_rows(self, most: float) -> int:
        """Rows of the planner's smaller probe: enough response positions for a full chunk of logits
        (:data:`LOGITS_CHUNK_ELEMENTS`, :func:`response_nll`), so that only activations grow between the probes;
        1 when a chunk is never full within ``most`` rows."""
        positions = int((self.probe_batch(1)["labels"][:, 1:] != IGNORE).sum())
        chunk = max(1, LOGITS_CHUNK_ELEMENTS // self.loaded.net.get_output_embeddings().weight.shape[0])
        rows = math.ceil(chunk / max(positions, 1))
        return rows if rows + 2 <= most else 1

    def device_batch(self, batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """A step's inputs staged on ``device`` (:func:`~fedlowrank.device.stage`): the token ids, mask or
        positions, and where the loss is, found on the host (:func:`response_positions`): ``response_at`` ``[N]``
        (flat indices ``b·T + t``) and ``response_tokens`` ``[N]``. With length buckets (static shapes) N is fixed
        by the batch's number of examples E, :meth:`response_bound`, the positions past the batch's own pointing
        at position 0 with target :data:`IGNORE` (no loss, no count): a compiled step then sees one shape per
        bucket."""
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        at, tokens, _ = response_positions(batch["labels"])
        if self.length_buckets:
            examples = batch["example_count"] if "example_count" in batch else (
                len(batch["example_index"]) if "example_index" in batch else len(batch["labels"]))
            pad = self.response_bound(examples) - len(at)
            at = torch.cat([at, at.new_zeros(pad)])
            tokens = torch.cat([tokens, tokens.new_full((pad,), IGNORE)])
        return stage({**inputs, "response_at": at, "response_tokens": tokens}, device)

    def response_bound(self, examples: int) -> int:
        """The most response positions a batch of ``examples`` training examples can have: those of the
        ``examples`` training examples with the most."""
        return int(self.response_counts[min(examples, len(self.train))])

    def hidden_states(self, net: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """The last hidden states ``[B, T, H]`` (after the final norm) of the network's decoder, without the
        language-model head, from a :meth:`device_batch`; a packed batch passes its positions and no mask
        (transformers' packed sequences)."""
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        return net.get_decoder()(**inputs, use_cache=False).last_hidden_state

    def compiled_module(self, net: nn.Module) -> nn.Module:
        """:meth:`output` of a staged batch as one module (:class:`StepOutput`: the decoder, the head at the response
        positions and the cross-entropy; the positions were found on the host), which ``run.compile`` compiles as
        one graph per shape."""
        if net not in self._outputs:
            self._outputs[net] = StepOutput(self, net)
        return self._outputs[net]

    def loss(self, net: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """Mean next-token cross-entropy over the batch's response tokens (0 when the batch has none left after
        truncation)."""
        return self.output_loss(self.output(net, batch), batch)

    def output(self, net: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """At each position, the negative log-likelihood of the next token when it is a response token, and 1 (its
        count), else 0: ``[B, T, 2]`` (fp32); the head only at the response positions (:func:`response_nll`). A
        staged batch (:meth:`device_batch`) goes through :meth:`compiled_module`."""
        if "response_at" in batch:
            return self.compiled_module(net)(batch)
        batch = stage(batch, module_device(net))  # a batch as :meth:`batch` gives it (privacy.dpsgd slices it)
        return self.staged_output(net, batch, *response_positions(batch["labels"])[:2])

    def staged_output(self, net: nn.Module, batch: dict[str, Any], flat: torch.Tensor,
                      targets: torch.Tensor) -> torch.Tensor:
        """:meth:`output` with the response positions ``flat`` ``[N]`` and their next tokens ``targets`` ``[N]``
        given (:data:`IGNORE`: a padding position)."""
        hidden = self.hidden_states(net, batch)
        nll = response_nll(hidden.flatten(0, 1).index_select(0, flat), targets, LMHead.of(net))
        out = nll.new_zeros(hidden.shape[0] * hidden.shape[1], 2)
        counted = (targets != IGNORE).to(nll.dtype)                                  # 0: a padding position
        return out.index_add(0, flat, torch.stack([nll, counted], 1)).view(*hidden.shape[:2], 2)

    def output_loss(self, out: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        """:meth:`loss` from the batch's part of :meth:`output`: read on the device, never on the host."""
        total = out.reshape(-1, 2).sum(0)
        return total[0] / total[1].clamp_min(1)

    def output_losses(self, out: torch.Tensor, routing: Routing, joined: dict[str, Any]) -> torch.Tensor:
        """:meth:`output_loss` of every member at once: ``[K]`` (a position counts for the member of its token)."""
        if routing.rows is not None:
            out, member = out.sum(1), routing.member_of_rows(out.device)
        else:
            out, member = out.reshape(-1, 2), routing.member_of_tokens(out.device)  # padding: 0s
        total = out.new_zeros(routing.size, 2).index_add(0, member, out)
        return total[:, 0] / total[:, 1].clamp_min(1)

    def join_batches(self, batches: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], Routing]:
        """The members' host batches (:meth:`batch`) as one: right padding as in :func:`collate` (the pad token,
        mask 0, label -100), or, packed, every member's examples packed together (:func:`pack`) with each token's
        member (:class:`Routing` by tokens; with length buckets in a static shape, :class:`PackShapes`, and a
        routing of fixed width: the most tokens a member of as many examples can have)."""
        if not self.pack:
            return join_padded(batches, {"input_ids": self.tokenizer.pad_token_id, "attention_mask": 0,
                                         "labels": IGNORE})
        groups = [[self.train[int(i)] for i in b["example_index"]] for b in batches]
        joined, members = pack(groups, self.pack, self.tokenizer.pad_token_id, self.length_buckets, self.shapes)
        width = self.shapes.member_tokens(max(len(g) for g in groups)) if self.shapes else 0
        return {**joined, "example_count": sum(len(g) for g in groups)}, Routing(tokens=members, size=len(batches),
                                                                                width=width)

    def features(self, net: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """``[B, d]`` last hidden state averaged over each example's tokens (padding excluded)."""
        if "attention_mask" not in batch:
            raise ValueError("task.options.pack: a packed row holds several examples, so a method that reads "
                             "each example's features (moon) needs pack = 0")
        batch = stage(batch, module_device(net))
        hidden = self.hidden_states(net, batch)
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)

    @torch.no_grad()
    def _token_loss(self, net: nn.Module, examples: list[Encoded]) -> dict[str, float]:
        """Mean cross-entropy over the response tokens of ``examples`` (length-sorted) and its perplexity; the
        sum stays on the device until the end."""
        net.eval()
        total = torch.zeros(2, dtype=torch.float64, device=module_device(net))  # summed nll, response tokens
        for start in range(0, len(examples), self.eval_batch_size):
            batch = collate(examples[start:start + self.eval_batch_size], self.tokenizer.pad_token_id)
            total += self.output(net, self.device_batch(batch, total.device)).reshape(-1, 2).sum(0)
        nll, count = total.tolist()
        loss = nll / max(count, 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}

    def evaluate_examples(self, net: nn.Module, indices: np.ndarray) -> dict[str, float]:
        """Loss and perplexity on the training examples at ``indices`` (a validation split for tuning)."""
        return self._token_loss(net, sorted((self.train[int(i)] for i in indices), key=lambda e: len(e.ids)))

    def evaluate(self, net: nn.Module) -> dict[str, float]:
        return self._evaluate(net, self.eval_encoded, list(zip(self.generate_idx, self.generation_prompts)))

    def evaluate_subset(self, net: nn.Module, keep: np.ndarray) -> dict[str, float]:
        """:meth:`evaluate` on the examples of the two fixed evaluation subsets that ``keep`` ``[num_test]``
        holds; ``exact_match`` only when one of them is in the generation subset."""
        return self._evaluate(net, [e for e, i in zip(self.eval_encoded, self.eval_order) if keep[i]],
                              [(i, p) for i, p in zip(self.generate_idx, self.generation_prompts) if keep[i]])

    @torch.no_grad()
    def _evaluate(self, net: nn.Module, examples: list[Encoded],
                  questions: list[tuple[int, list[int]]]) -> dict[str, float]:
        """Token loss on ``examples`` (length-sorted) and exact match on ``questions`` (test index, prompt ids);
        each metric only when it has examples (the loss: with a response token left after truncation)."""
        if self.loaded.speed_and_memory_only:  # random weights: no metric would mean anything
            if not self._said_speed_only:
                log.warning("causal-lm: task.model = %r has %s; evaluation skipped", self.model_name,
                            SPEED_AND_MEMORY_ONLY)
                self._said_speed_only = True
            return {}
        scored = [e for e in examples if not e.lost_response]  # the others have no response token left
        metrics = self._token_loss(net, scored) if scored else {}
        if questions:
            outputs = generate(net, self.tokenizer, [p for _, p in questions], self.max_new_tokens,
                               self.generation_batch_size)
            records = []
            for (i, _), out in zip(questions, outputs):
                text = self.tokenizer.decode(out, skip_special_tokens=True)
                reference = self.data.test_responses[i]
                predicted = extract_answer(text)
                records.append({"test_index": int(i), "prompt": self.data.test_prompts[i], "reference": reference,
                                "output": text, "extracted": predicted,
                                "correct": predicted is not None and predicted == extract_answer(reference)})
            metrics["exact_match"] = sum(r["correct"] for r in records) / len(records)
            self._generations = records[:self.write_generations]
        return metrics

    def pop_generations(self) -> list[dict[str, Any]]:
        out, self._generations = self._generations, []
        return out

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model_name, "source": self.loaded.source,
                "num_train": self.num_train, "num_test": len(self.data.test_prompts),
                "template": "chat" if uses_chat_template(self.tokenizer) else "plain", "max_length": self.max_length,
                "truncation": self.truncation, "eval_examples": len(self.eval_idx),
                "eval_generate": len(self.generate_idx), "max_new_tokens": self.max_new_tokens}
