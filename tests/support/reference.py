"""Independent float64 reference of sapipe's update rules (docs/design.md §2–§3).

A single process simulates ALL ranks of a data-parallel job. It deliberately shares no
code with ``sapipe``: the optimizer math is done by the real ``torch.optim`` optimizers,
layer ordering by its own forward pre-hooks, and every rule is written out literally.

Notation (docs/design.md): n ranks; user iteration ``it`` = 1, 2, ...; with ``W`` warm-up
iterations the pipeline step is ``t = it - W``. l_t^r: rank r's local gradient, g_t: their
mean. S: parameters of layers 1..k (stale), N: the rest (synchronous).

Interpretations made here (kept explicit so a test failure can be judged):
* Two optimizers are built with ``optimizer_factory``: one over S, one over N. Every
  optimizer sapipe accepts is per-parameter (SGD/Adam/AdamW, and any other on its generic
  path: RMSprop, Lion, ...; docs/design.md §3.10), so this equals one optimizer.
  During warm-up both are stepped with g_t (S state advances during warm-up).
* x_j for j <= 0 (pipeline numbering) is the pipeline's start weights x_0 (= weights after
  warm-up). Hence Δ = x_{t-1} - x_{t-1-s} is zero at the first real update.
* A parameter that gets no gradient on a rank (its module did not run there) contributes a
  zero gradient to the mean. One that got no gradient on ANY rank in an iteration is unused
  (docs/design.md §3.9): wherever that iteration's gradient is applied (a sync or warm-up
  step, a stale step s iterations later, a restart's drain) it is handed to the optimizer
  with ``grad = None``, so ``torch.optim`` skips it (weights, state and its own step count
  untouched, as under DDP with find_unused_parameters=True). Under WP such a parameter is
  not predicted at that step either (x̃_{t+1} = x_t); at steps without a real update (t <= s)
  predictions are not masked.
* OPT_peek uses the optimizer's hyper-parameters as set for the current iteration.
* A layer whose every parameter was already claimed by an earlier-executed layer (a module
  holding only a tied weight) is not a layer (it owns nothing); it is not counted in k.
* ``clip`` (a function of {name: gradient}, e.g. :func:`clip_by_norm`): the gradient one step
  applies is clipped as a whole — the sync layers' g_t together with the stale layers'
  g_{t-s} (none while the pipeline fills; all of g_t during warm-up); parameters no rank
  used are not in it. The clipped g_{t-s} is what the stale update, delay compensation and
  wp2/wp3's predictions use; this rank's own l_t (wp1, wp3) is not clipped.
* ``reduce`` (e.g. :func:`compressed_mean`): how the ranks' gradients become g_t, instead
  of their exact mean; parameters no rank used are still None.
* ``restarts`` [(I, k'), ...]: after user iteration I's step, the stale gradients still
  in flight (pipeline steps t-s+1..t) are applied oldest first as plain OPT steps with
  that step's learning rate, the held weights become the real ones, and the pipeline
  starts again with k' stale layers as after a warm-up of I iterations (optimizer state
  moves with each parameter).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

__all__ = [
    "ReferenceResult",
    "run_reference",
    "layer_order",
    "opt_peek",
    "dc_correct",
    "clip_by_norm",
    "clip_by_value",
    "compressed_mean",
    "node_first_mean",
]

Tensors = dict[str, torch.Tensor]


@dataclass
class ReferenceResult:
    real: list[Tensors]  # real[i]: real weights x after user iteration i+1
    held: list[list[Tensors]]  # held[i][r]: weights rank r's model holds for iteration i+2
    order: list[str]  # layer module names in forward-execution order
    stale_names: set  # parameter names in S
    layer_params: dict[str, list[str]] = field(default_factory=dict)  # layer -> its param names
    global_grads: list[Tensors] = field(default_factory=list)  # g for each iteration
    local_grads: list[list[Tensors]] = field(default_factory=list)  # l per iteration per rank
    auto_scores: dict[str, float] = field(default_factory=dict)  # "auto": Σ‖x̃ − x‖² each
    auto_choice: str | None = None  # "auto": the candidate chosen


# ----------------------------------------------------------------------------------------
# Layers in forward-execution order
# ----------------------------------------------------------------------------------------


def layer_order(model: nn.Module, example_input):
    """Return ``(order, layer_params)``.

    ``order``: names of modules that directly own parameters, in the order they first
    execute in a forward pass on ``example_input`` (modules that never run go last, in
    registration order). ``layer_params[layer]``: canonical parameter names (as in
    ``model.named_parameters()``, tied params once under their first name) owned by the
    layer; a tied parameter belongs to the first executed module that registers it.
    Runs on a deep copy, so ``model`` is untouched.
    """
    m = copy.deepcopy(model)
    canon = {id(p): name for name, p in m.named_parameters()}  # tied -> first name
    owners = [
        (name, mod)
        for name, mod in m.named_modules()
        if len(list(mod.parameters(recurse=False))) > 0
    ]

    executed: list[str] = []
    handles = []
    for name, mod in owners:

        def hook(_mod, _args, _name=name):
            if _name not in executed:
                executed.append(_name)

        handles.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            m(example_input)
    finally:
        for h in handles:
            h.remove()

    by_name = dict(owners)
    candidates = executed + [name for name, _ in owners if name not in executed]
    order, layer_params, claimed = [], {}, set()
    for name in candidates:
        mine = []
        for p in by_name[name].parameters(recurse=False):
            if id(p) not in claimed:
                claimed.add(id(p))
                mine.append(canon[id(p)])
        if mine:
            order.append(name)
            layer_params[name] = mine
    return order, layer_params


# ----------------------------------------------------------------------------------------
# Small math helpers
# ----------------------------------------------------------------------------------------


def dc_correct(g: torch.Tensor, delta: torch.Tensor, lam: float, form: str) -> torch.Tensor:
    """DC_λ(g, Δ) for ONE parameter tensor."""
    if form == "outer":
        return g + lam * torch.sum(g * delta) * g
    if form == "diagonal":
        return g + lam * g * g * delta
    raise ValueError(f"dc_form must be 'outer' or 'diagonal', got {form!r}")


def opt_peek(
    optimizer_factory,
    opt: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """OPT_peek: weights that ``opt.step()`` would give for ``grads`` at ``params``.

    Works on copies: fresh parameter tensors, a fresh optimizer from the factory with a
    DEEP copy of ``opt``'s state and hyper-parameters. ``opt`` and ``params`` are untouched.
    """
    tmp = [nn.Parameter(p.detach().clone()) for p in params]
    tmp_opt = optimizer_factory(tmp)
    tmp_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, g in zip(tmp, grads):
        p.grad = None if g is None else g.detach().clone()
    tmp_opt.step()
    return [p.detach().clone() for p in tmp]


def _step(
    opt: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
):
    """OPT: one real step of ``opt`` with the given gradients (None: the parameter is skipped)."""
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.detach().clone()
    opt.step()
    for p in params:
        p.grad = None


def _clipped(
    clip: Callable[[Tensors], Tensors],
    sync: dict[str, torch.Tensor | None],
    stale: dict[str, torch.Tensor | None],
) -> dict[str, torch.Tensor | None]:
    """``clip`` applied to the gradients of one step as a whole (None entries: not applied, not
    clipped); returns new tensors, the inputs are left as they are."""
    both = {**sync, **stale}
    present = {nm: v.clone() for nm, v in both.items() if v is not None}
    out = clip(present) if present else {}
    return {nm: out.get(nm) if both[nm] is not None else None for nm in both}


def clip_by_norm(max_norm: float, norm_type: float = 2.0) -> Callable[[Tensors], Tensors]:
    """torch.nn.utils.clip_grad_norm_'s rule, written out: g * min(1, c / (||g|| + 1e-6))."""

    def clip(grads: Tensors) -> Tensors:
        norms = torch.stack([v.norm(norm_type) for v in grads.values()])
        total = norms.max() if norm_type == float("inf") else norms.norm(norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return {nm: v * coef for nm, v in grads.items()}

    return clip


def clip_by_value(limit: float) -> Callable[[Tensors], Tensors]:
    """torch.nn.utils.clip_grad_value_'s rule: every element clamped to [-limit, limit]."""
    return lambda grads: {nm: v.clamp(-limit, limit) for nm, v in grads.items()}


def compressed_mean(
    kind: str,
    buckets: Sequence[Sequence[tuple[str, int]]] | None = None,
    block: int = 64,
    error_feedback: bool | None = None,
    chunks: Sequence[Sequence[tuple[int, int]]] | None = None,
    ranks_per_message: int = 1,
) -> Callable[[list[Tensors]], Tensors]:
    """The mean of the ranks' gradients as sapipe's compressed sum delivers it (docs/design.md
    §5.9), as a function of the ranks' gradients, one call per iteration (error feedback keeps
    its residuals between calls).

    Every bucket is split into W shards (int8: each a whole number of ``block``-value blocks,
    zero-padded); rank r's shard j is rounded once as r's, the W rounded shards are added in
    float64 in rank order, and the sum is rounded once more. 16-bit: each value cast through
    float32, a rank's as value / L, the sum as sum / W, which is what arrives. int8: per
    block, the float32 scale s = max|v| / 127 (0 below float32's normal range) and
    q = round(v · (1 / s)) clamped to ±127; the sum arrives as q · (s / (W · L)), that
    division of the scale taken in float32.
    With error feedback
    (``None``: int8 only) v is the value plus the residual that rank (or, for the sum, the
    shard's owner) kept from its last call: what v's rounding dropped.
    ``buckets``: per bucket, its (parameter name, numel) in flat order (int8 only).
    ``chunks``: per bucket, the [start, end) of each of its partitions (``backend="pushpull"``;
    node-first shards, whose last may reach past the bucket's end, zero-padded): each
    partition is split into W shards and summed as above on its own; None: the bucket is one
    partition.
    ``ranks_per_message``: L, how many ranks' gradients each "rank" here stands for (a node's
    sum, :func:`node_first_mean`); the result is the mean over all W · L.
    """
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(kind)
    feedback = kind == "int8" if error_feedback is None else error_feedback
    residual: dict[tuple, torch.Tensor] = {}

    def fed(
        values: torch.Tensor, key: tuple, rounded: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``rounded(values + residual)``, the residual becoming what that rounding dropped."""
        v = values + residual.get(key, torch.zeros_like(values)) if feedback else values
        out = rounded(v)
        if feedback:
            residual[key] = v - out
        return out

    def int8(v: torch.Tensor, quantised: list | None = None) -> torch.Tensor:
        """``v`` rounded as int8 blocks (what it decodes to); ``quantised`` receives (q, s)."""
        blocks = v.reshape(-1, block)
        scale = (blocks.abs().max(dim=1).values / 127).to(torch.float32).to(torch.float64)
        scale = torch.where(
            scale < torch.finfo(torch.float32).tiny, torch.zeros_like(scale), scale
        )  # sent as zeros
        q = torch.round(
            blocks * (1 / torch.where(scale > 0, scale, torch.ones_like(scale)))[:, None]
        ).clamp(-127, 127)
        if quantised is not None:
            quantised[:] = [q, scale]
        return (q * scale[:, None]).reshape(-1)

    def reduce_16_bit(local: list[Tensors]) -> Tensors:
        world = len(local)

        def sixteen(divide):
            return lambda v: (v / divide).to(torch.float32).to(half).to(torch.float64) * divide

        mean: Tensors = {}
        for nm in local[0]:
            total = sum(
                fed(grads[nm], ("rank", r, nm), sixteen(ranks_per_message)) / ranks_per_message
                for r, grads in enumerate(local)
            )
            mean[nm] = fed(total, ("sum", nm), sixteen(world)) / world
        return mean

    def reduce_int8(flat: list[torch.Tensor], unit: tuple) -> torch.Tensor:
        """The mean of the ranks' ``flat`` values (one partition) as int8's two roundings
        deliver it."""
        world, numel = len(flat), flat[0].numel()
        shard = math.ceil(math.ceil(numel / world) / block) * block
        padded = [torch.nn.functional.pad(f, (0, world * shard - numel)) for f in flat]
        sent = [
            [fed(f[j * shard : (j + 1) * shard], ("rank", r, unit, j), int8) for j in range(world)]
            for r, f in enumerate(padded)
        ]
        total = []
        for j in range(world):
            acc = sent[0][j].clone()
            for r in range(1, world):
                acc += sent[r][j]
            q_s: list = []
            fed(acc, ("sum", unit, j), lambda v, q_s=q_s: int8(v, q_s))
            q, scale = q_s
            arrived = (scale.to(torch.float32) / (world * ranks_per_message)).to(torch.float64)
            total.append((q * arrived[:, None]).reshape(-1))
        return torch.cat(total)[:numel]

    def reduce(local: list[Tensors]) -> Tensors:
        if half is not None:
            return reduce_16_bit(local)
        assert buckets is not None, "int8 needs the bucket layout"
        mean: Tensors = {}
        for b, layout in enumerate(buckets):
            numel = sum(n for _, n in layout)
            bounds = chunks[b] if chunks is not None else [(0, numel)]
            end = max(hi for _, hi in bounds)
            flat = [
                torch.nn.functional.pad(
                    torch.cat([grads[nm].reshape(-1) for nm, _ in layout]), (0, end - numel)
                )
                for grads in local
            ]
            values = torch.cat(
                [reduce_int8([f[lo:hi] for f in flat], (b, c)) for c, (lo, hi) in enumerate(bounds)]
            )
            values = values[:numel]
            offset = 0
            for nm, n in layout:
                mean[nm] = values[offset : offset + n].view_as(local[0][nm])
                offset += n
        return mean

    return reduce


def node_first_mean(
    kind: str,
    buckets: Sequence[Sequence[tuple[str, int]]],
    nodes: Sequence[Sequence[int]],
    error_feedback: bool | None = None,
) -> Callable[[list[Tensors]], Tensors]:
    """The mean as sapipe's compressed sum node first delivers it (sapipe.comm.hierarchical):
    each node's gradients summed exactly (in rank order), and those N sums summed compressed
    as messages of L ranks each (:func:`compressed_mean`), each bucket cut into L shards of
    ceil(numel / L) values (zero-padded past the bucket's end), each shard summed over the
    nodes on its own."""
    size = len(nodes[0])
    chunks = []
    for layout in buckets:
        shard = math.ceil(sum(n for _, n in layout) / size)
        chunks.append([(j * shard, (j + 1) * shard) for j in range(size)])
    across = compressed_mean(
        kind, buckets, chunks=chunks, error_feedback=error_feedback, ranks_per_message=size
    )

    def reduce(local: list[Tensors]) -> Tensors:
        return across([{nm: sum(local[r][nm] for r in node) for nm in local[0]} for node in nodes])

    return reduce


def _to64(obj):
    if torch.is_tensor(obj):
        return obj.to(torch.float64) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to64(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to64(v) for k, v in obj.items()}
    return obj


# ----------------------------------------------------------------------------------------
# The simulation
# ----------------------------------------------------------------------------------------

_MODES = ("none", "dc", "wp1", "wp2", "wp3", "t2", "auto")
AUTO_CANDIDATES = ("none", "wp1", "wp2", "wp3")  # compensation="auto"'s default candidates
T2_DECAY = 0.1  # D of compensation="t2" (PipeMare's discrepancy-correction decay)


def run_reference(
    model: nn.Module,
    optimizer_factory: Callable,
    batches,
    loss_fn,
    *,
    stale_layers: int,
    compensation: str = "none",
    dc_lambda: float = 0.2,
    dc_form: str = "outer",
    staleness: int = 1,
    warmup_steps: int = 0,
    lr_at: Callable[[int], float] | None = None,
    lr_ramp_steps: int = 0,
    restarts: Sequence[tuple[int, int]] = (),
    clip: Callable[[Tensors], Tensors] | None = None,
    reduce: Callable[[list[Tensors]], Tensors] | None = None,
    probe_steps: int = 20,
    candidates: Sequence[str] = AUTO_CANDIDATES,
) -> ReferenceResult:
    """``compensation="auto"`` (design §3.14): every candidate's x̃_{t+1} from pipeline step
    t = 3 on, scored at t + 1 by the squared distance to x_{t+1} summed over ranks; after step
    ``probe_steps`` + 2 the stale set runs the candidate with the smallest score (the last
    candidate until then). ``res.auto_scores`` holds the scores, ``res.auto_choice`` the pick."""
    if compensation not in _MODES:
        raise ValueError(f"compensation must be one of {_MODES}, got {compensation!r}")
    if dc_form not in ("outer", "diagonal"):
        raise ValueError(f"dc_form must be 'outer' or 'diagonal', got {dc_form!r}")
    if staleness < 1:
        raise ValueError("staleness must be >= 1")
    if staleness > 1 and compensation not in ("none", "dc", "t2"):
        raise ValueError("staleness > 1 is only defined for 'none', 'dc' and 't2'")
    s, W, K = staleness, warmup_steps, lr_ramp_steps
    auto = compensation == "auto"
    wp = compensation.startswith("wp") or auto

    # ---- float64 model copy; canonical parameter names -------------------------------
    net = copy.deepcopy(model).to(torch.float64)
    net.train()
    model_params: dict[str, nn.Parameter] = dict(net.named_parameters())  # tied: once
    names = list(model_params)
    batches = [[_to64(b) for b in step] for step in batches]
    n = len(batches[0])

    # ---- layers, S and N ---------------------------------------------------------------
    order, layer_params = layer_order(net, batches[0][0][0])
    for k in [stale_layers] + [k for _, k in restarts]:
        if not 0 <= k <= len(order):
            raise ValueError(f"stale_layers must be in [0, {len(order)}], got {k}")
    restart_at = dict(restarts)

    # ---- real weights x (leaf tensors) and the two optimizers ---------------------------
    x: dict[str, nn.Parameter] = {
        nm: nn.Parameter(model_params[nm].detach().clone()) for nm in names
    }
    base_lr: dict[int, list[float]] = {}

    def split(k, old_opts=()):
        """(stale names, S, N, opt_S, opt_N) for k; optimizer state moves from ``old_opts``."""
        stale = {p for layer in order[:k] for p in layer_params[layer]}
        s_names = [nm for nm in names if nm in stale]
        n_names = [nm for nm in names if nm not in stale]
        opts = [
            optimizer_factory([x[nm] for nm in nms]) if nms else None for nms in (s_names, n_names)
        ]
        for o in opts:
            if o is None:
                continue
            base_lr[id(o)] = [grp["lr"] for grp in o.param_groups]
            for grp in o.param_groups:
                for p in grp["params"]:
                    for old in old_opts:
                        if old is not None and p in old.state:
                            o.state[p] = old.state[p]
        return (stale, s_names, n_names, *opts)

    stale_names, S, N, opt_S, opt_N = split(stale_layers)
    all_stale = set(stale_names)

    def set_lr(opt, it, scale=1.0):
        if opt is None:
            return
        for grp, lr0 in zip(opt.param_groups, base_lr[id(opt)]):
            grp["lr"] = (lr_at(it) if lr_at is not None else lr0) * scale

    def cur(nms):  # current real weights (clones)
        return {nm: x[nm].detach().clone() for nm in nms}

    # ---- pipeline history (pipeline step index t) --------------------------------------
    X: list[Tensors] = []  # X[t]: real S weights after pipeline step t (X[0] = start)
    G: dict[int, Tensors] = {}  # G[t]: g_t of S params
    L: dict[int, list[Tensors]] = {}  # L[t][r]: l_t^r of S params
    pred: list[Tensors] | None = None  # x̃ for S, per rank (None = hold real weights)
    velocity: Tensors = {}  # t2: δ_t of S

    res = ReferenceResult(
        real=[], held=[], order=order, stale_names=all_stale, layer_params=layer_params
    )
    auto_guesses: dict[str, list[Tensors]] | None = None  # x̃_t of each candidate, per rank
    if auto:
        res.auto_scores = {c: 0.0 for c in candidates}

    def prediction(mode: str, t: int, r: int):
        """g̃ of ``mode`` at pipeline step t for rank r (None: x̃_{t+1} = x_t)."""
        if mode == "none":
            return None
        if mode == "wp1":
            return L[t][r]
        if t == 1:  # wp2 / wp3 without g_{t-1}: x̃_2 = x_1
            return None
        if mode == "wp2":
            return G[t - 1]
        return {  # wp3
            nm: None
            if G[t - 1][nm] is None
            # skipped: no prediction
            else dc_correct(
                G[t - 1][nm] - L[t - 1][r][nm] / n,
                X[t][nm] - X[t - 1][nm],
                dc_lambda,
                dc_form,
            )
            + L[t][r][nm] / n
            for nm in S
        }

    def peeked(g_tilde, t: int) -> Tensors:
        if g_tilde is None:
            return cur(S)
        skipped = {nm for nm in S if t > s and G[t - s][nm] is None}
        out = opt_peek(
            optimizer_factory,
            opt_S,
            [x[nm] for nm in S],
            [None if nm in skipped else g_tilde[nm] for nm in S],
        )
        return dict(zip(S, out))

    for it in range(1, len(batches) + 1):
        # -- 1. every rank: forward/backward at the weights its model holds ---------------
        local: list[Tensors] = []
        used: list[dict[str, bool]] = []
        for r in range(n):
            with torch.no_grad():
                for nm in names:
                    src = pred[r][nm] if (pred is not None and nm in stale_names) else x[nm]
                    model_params[nm].copy_(src)
                    model_params[nm].grad = None
            inputs, targets = batches[it - 1][r]
            loss_fn(net(inputs), targets).backward()
            used.append({nm: model_params[nm].grad is not None for nm in names})
            local.append(
                {
                    nm: (
                        model_params[nm].grad.detach().clone()
                        if model_params[nm].grad is not None
                        else torch.zeros_like(model_params[nm])
                    )
                    for nm in names
                }
            )
        g = (
            reduce(local)
            if reduce is not None
            else {nm: sum(grads[nm] for grads in local) / n for nm in names}
        )
        for nm in names:  # no rank used it: the optimizer skips it wherever g is applied
            if not any(used[r][nm] for r in range(n)):
                g[nm] = None
        res.local_grads.append(local)
        res.global_grads.append(g)

        if it <= W:
            # -- warm-up: fully synchronous (k = 0) ---------------------------------------
            g_warm = _clipped(clip, g, {}) if clip is not None else g
            for opt, nms in ((opt_S, S), (opt_N, N)):
                if opt is not None:
                    set_lr(opt, it)
                    _step(opt, [x[nm] for nm in nms], [g_warm[nm] for nm in nms])
        else:
            t = it - W  # pipeline step
            if t == 1:
                X.append(cur(S))  # x_0: pipeline start
                velocity = {nm: torch.zeros_like(x[nm]) for nm in S}  # δ_0 = 0

            # -- 1b. clipping: the gradient this step applies, sync g_t and stale g_{t-s}, as one
            g_sync = {nm: g[nm] for nm in N}
            if clip is not None:
                clipped = _clipped(clip, g_sync, G[t - s] if t > s else {})
                g_sync = {nm: clipped[nm] for nm in N}
                if t > s:
                    G[t - s] = {nm: clipped[nm] for nm in S}  # what is applied (and predicted from)

            # -- 2. sync set N: x_t = OPT(x_{t-1}, g_t) -----------------------------------
            if opt_N is not None:
                set_lr(opt_N, it)
                _step(opt_N, [x[nm] for nm in N], [g_sync[nm] for nm in N])

            # -- 3. stale set S --------------------------------------------------------
            G[t] = {nm: g[nm] for nm in S}
            L[t] = [{nm: grads[nm] for nm in S} for grads in local]
            scale = 1.0
            if s > 1 and K > 0:  # PipeMare T1: lr / s^{p_t}, p_t = 1 - min(t/K, 1)
                scale = 1.0 / (s ** (1.0 - min(t / K, 1.0)))
            set_lr(opt_S, it, scale)
            if opt_S is not None and t > s:
                g_old = G[t - s]
                if compensation == "dc":
                    x_prev = X[t - 1]
                    x_back = X[max(t - 1 - s, 0)]
                    g_hat = {
                        nm: None
                        if g_old[nm] is None
                        else dc_correct(g_old[nm], x_prev[nm] - x_back[nm], dc_lambda, dc_form)
                        for nm in S
                    }
                else:  # none, wp1, wp2, wp3, t2: the real update uses g_{t-s}
                    g_hat = g_old
                _step(opt_S, [x[nm] for nm in S], [g_hat[nm] for nm in S])
            X.append(cur(S))  # X[t] = x_t (= x_{t-1} when no update)

            # -- 4a. PipeMare T2: x̃_{t+1} = x_t + s·δ_t, δ_t = γδ_{t-1} + (1-γ)(x_t - x_{t-1}),
            #        γ = D^{1/s}; the same on every rank
            if compensation == "t2" and opt_S is not None:
                gamma = T2_DECAY ** (1.0 / s)
                for nm in S:
                    velocity[nm] = gamma * velocity[nm] + (1 - gamma) * (X[t][nm] - X[t - 1][nm])
                pred = [{nm: X[t][nm] + s * velocity[nm] for nm in S} for _ in range(n)]

            # -- 4a'. compensation="auto": score last step's guesses, guess x_{t+1}, decide ---
            mode = compensation
            if auto and opt_S is not None:
                if t > s and res.auto_choice is None:
                    if auto_guesses is not None:
                        for c in candidates:
                            res.auto_scores[c] += sum(
                                float(((auto_guesses[c][r][nm] - X[t][nm]) ** 2).sum())
                                for r in range(n)
                                for nm in S
                            )
                    auto_guesses = (
                        {c: [peeked(prediction(c, t, r), t) for r in range(n)] for c in candidates}
                        if t > s + 1
                        else None
                    )
                mode = res.auto_choice or candidates[-1]
                if t == probe_steps + 2:
                    res.auto_choice = min(candidates, key=lambda c: res.auto_scores[c])

            # -- 4b. weight prediction for the next iteration: x̃_{t+1} = OPT_peek(x_t, g̃) --
            if wp and opt_S is not None:
                pred = [peeked(prediction(mode, t, r), t) for r in range(n)]

        # -- restart: drain the stale gradients in flight, then a new pipeline ------------
        if it in restart_at:
            if it > W:
                t = it - W
                for j in range(max(t - s + 1, 1), t + 1):
                    if opt_S is not None:
                        _step(opt_S, [x[nm] for nm in S], [G[j][nm] for nm in S])
            pred = None
            stale_names, S, N, opt_S, opt_N = split(restart_at[it], (opt_S, opt_N))
            all_stale |= stale_names
            W, X, G, L = it, [], {}, {}

        # -- 5. record -------------------------------------------------------------------
        real = cur(names)
        res.real.append(real)
        held = []
        for r in range(n):
            h = dict(real)
            if pred is not None:
                h.update({nm: pred[r][nm].clone() for nm in S})
            held.append({nm: v.clone() for nm, v in h.items()})
        res.held.append(held)

    return res
