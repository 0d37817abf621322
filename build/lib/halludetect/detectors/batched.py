"""The seeds of one (method, layer) trained together, as one batched model in one process.

`train_detector` (training.py) trains one seed; `train_batched` trains S seeds at once and gives
each seed the `TrainResult` that `train_detector` gives it, to float tolerance (tested per method,
tests/detectors/test_batched.py). What makes the numbers the same:

- randomness: each seed's network is built as `train_detector` builds it (torch.manual_seed(seed),
  then build_detector), and its dropout masks come from a generator of its own holding the global
  state right after that build, so they are the masks the global generator gave it, in the same
  order; its batch order comes from its own torch.Generator().manual_seed(seed), as before.
  torch's global generator is left as the caller had it.
- data: each step gathers every seed's batch of bags (the same number of bags for every seed, not
  the same bags) into one packed `Bags` of S * B bags, seed after seed. Poolings, top-k, ReLU and
  the other elementwise maps run on it as one batch: a bag's result never depends on its
  neighbours. What mixes the rows of one seed runs per seed on its own rows: the linear layers
  (each seed's weights on its rows, the very addmm of nn.Linear), batch norm (a seed's statistics
  over its own real tokens), the dropout draws and the loss (a seed's mean over its own bags).
- optimiser: the parameters are stacked over seeds, [S, *shape]; the total loss is the sum of the
  seeds' losses, so each slice of a stacked gradient is that seed's own gradient, and `StackedAdam`
  applies torch.optim.Adam's CPU arithmetic elementwise, with one learning rate per seed (the
  authors' ReduceLROnPlateau steps each seed's rate on that seed's validation loss, the HaMI
  code's on that seed's training loss of every step).
- evaluation (per-epoch scores, margins, the gradient-ratio trace) runs on each seed's own
  nn.Module with its current weights loaded: the code `train_detector` runs.

What could still differ is float noise of op layout: an elementwise kernel rounds its vectorised
body and its scalar tail apart, and a seed's elements sit elsewhere in a stacked tensor than alone.
The transcendental maps (exp, tanh, sigmoid) and the top-k poolings therefore run per seed
(`per_seed`, `seed_topk`); what runs on the stack is exactly rounded (add, multiply, divide, sqrt,
max) or Adam's lerp and addcmul. Observed: every seed bit-equal to train_detector's, on the tests'
cell (tests/detectors/test_batched.py, which allows 1e-5) and on the world-shaped bags of
bench.training --batched, 100 epochs.

Only the built-in networks (networks.py) are batched, and only the layers this module knows
(`batchable`); any other network (a user's plugin, a subclass) trains its seeds one after another
in this process instead (training.train_seeds), never with other numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as nn_functional

from halludetect.activations.bags import Bags
from halludetect.detectors import networks
from halludetect.detectors.build import build_detector
from halludetect.detectors.data import SplitData
from halludetect.detectors.gradient_ratio import GradientRatioTrace
from halludetect.detectors.inference import score
from halludetect.detectors.loop import (
    Recipe,
    TrainResult,
    check_recipe,
    epoch_batches,
    epoch_margins,
    logistic_loss,
    mil_sampler,
    recipe_of,
)
from halludetect.detectors.pooling import segment_softmax, segment_sum, topk_mean, topk_sigmoid_logit
from halludetect.metrics import auroc


# ---------------------------------------------------------------------------- stacked networks
@dataclass
class Layout:
    """How a packed batch of S seeds splits into the seeds' parts: rows per seed at token level
    (tokens [N, ...], N = sum(tokens)) and at bag level (bags [S * B, ...], B per seed)."""

    tokens: list[int]
    bags: list[int]


class Stack:
    """S seeds' networks of one method: every parameter and buffer stacked on a leading seed axis.

    `params[name]` [S, *shape] are the leaves the optimiser updates; `buffers[name]` [S, *shape]
    (batch norm's running statistics) are updated in place, a seed's slice by that seed's batch.
    `models[s]` is seed s's own nn.Module: the template of the batched forward and, with the seed's
    current weights loaded (`load`), what evaluates it."""

    def __init__(self, models: list[nn.Module], dropout_gens: list[torch.Generator]):
        self.models, self.gens = models, dropout_gens
        states = [m.state_dict() for m in models]
        names = [k for k, _ in models[0].named_parameters()]
        self.keys = list(states[0])  # state_dict order, as train_detector saves it
        self.params = {k: torch.stack([s[k].detach() for s in states]).requires_grad_() for k in names}
        self.buffers = {k: torch.stack([s[k] for s in states]) for k in self.keys if k not in self.params}

    def __len__(self) -> int:
        return len(self.models)

    def state_dict(self, s: int) -> dict[str, torch.Tensor]:
        """Seed s's weights, as train_detector's state dicts hold them (detached copies)."""
        return {k: (self.params[k] if k in self.params else self.buffers[k])[s].detach().clone() for k in self.keys}

    def load(self, s: int) -> nn.Module:
        """Seed s's nn.Module with its current weights."""
        self.models[s].load_state_dict(self.state_dict(s))
        return self.models[s]

    # ------------------------------------------------------------ layers, per seed where they mix rows
    def linear(self, name: str, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """x [N, in] (seed after seed, sizes[s] rows each) -> [N, out]: each seed's rows through its
        own Linear (F.linear, nn.Linear's own call, so each seed's product is the one it had alone)."""
        w, b = self.params[f"{name}.weight"].unbind(0), self.params[f"{name}.bias"].unbind(0)
        parts = x.split(sizes)
        return torch.cat([nn_functional.linear(p, w[s], b[s]) for s, p in enumerate(parts)])

    def batch_norm(self, name: str, module: nn.BatchNorm1d, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Training-mode batch norm: each seed normalised by the statistics of its own rows, its
        running statistics (its slice of the stacked buffers) updated as nn.BatchNorm1d does."""
        w, b = self.params[f"{name}.weight"].unbind(0), self.params[f"{name}.bias"].unbind(0)
        mean, var = self.buffers[f"{name}.running_mean"], self.buffers[f"{name}.running_var"]
        self.buffers[f"{name}.num_batches_tracked"].add_(1)
        out = [
            nn_functional.batch_norm(p, mean[s], var[s], w[s], b[s], True, module.momentum, module.eps)
            for s, p in enumerate(x.split(sizes))
        ]
        return torch.cat(out)

    def dropout(self, module: networks.Dropout, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """networks.Dropout in training mode, each seed's mask drawn from its own generator, of the
        shape it had alone ([sizes[s], *x.shape[1:]]), so that its stream stays the one it was."""
        if module.p == 0:
            return x  # draws nothing, as Dropout(0)
        u = torch.cat([torch.rand((n, *x.shape[1:]), generator=g) for n, g in zip(sizes, self.gens, strict=True)])
        keep = u >= module.p  # [*x.shape]
        return x * keep / (1 - module.p)

    def sequential(self, prefix: str, seq: nn.Sequential, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """An nn.Sequential of the layers in SEQUENTIAL_LAYERS, in training mode."""
        for i, layer in enumerate(seq):
            name = f"{prefix}.{i}"
            if isinstance(layer, nn.Linear):
                x = self.linear(name, x, sizes)
            elif isinstance(layer, nn.BatchNorm1d):
                x = self.batch_norm(name, layer, x, sizes)
            elif isinstance(layer, nn.ReLU):
                x = torch.relu(x)
            elif isinstance(layer, networks.Dropout):
                x = self.dropout(layer, x, sizes)
            else:  # batchable() refuses such a network before training
                raise TypeError(f"no batched form of {type(layer).__name__}")
        return x


SEQUENTIAL_LAYERS = (nn.Linear, nn.BatchNorm1d, nn.ReLU, networks.Dropout)


def per_seed(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """fn (an elementwise exp, tanh, sigmoid) applied to each seed's rows apart. Those kernels round
    their vectorised body and their scalar tail differently, and which elements fall in the tail
    depends on where a seed's rows start in x: apart, a seed's elements are computed as alone."""
    return torch.cat([fn(p) for p in x.split(sizes)])


def seed_topk(fn, s: torch.Tensor, mask: torch.Tensor, sizes: list[int], ratio: float) -> torch.Tensor:
    """A top-k pooling fn(s, mask, ratio) (pooling.py: s, mask [S * B, T] -> [S * B]) of each seed's
    bags apart: it takes the batch's largest k for every bag and sums over those ranks, and alone a
    seed's batch had its own largest k, so its sums ran over as many terms as they do here."""
    return torch.cat([fn(a, m, ratio) for a, m in zip(s.split(sizes), mask.split(sizes), strict=True)])


# ------------------------------------------------------------ the networks' forwards, batched
# Each: (stack, bags of S * B bags, layout) -> z [S * B], in training mode; the template
# (stack.models[0]) gives the hyperparameters, which are the same for every seed.
def hami_token_logits(st: Stack, bags: Bags, lay: Layout) -> torch.Tensor:
    """[N] HaMI.token_logits: one logit per real token."""
    m = st.models[0]
    h = bags.tokens
    if m.lam:
        if bags.p_sem is None:
            raise ValueError("hami_sp needs the semantic probability of every response (Bags.p_sem)")
        h = h * bags.per_token(1 + m.lam * bags.p_sem)[:, None]  # [N, d]
    return st.sequential("net", m.net, h, lay.tokens).squeeze(-1)


def hami(st: Stack, bags: Bags, lay: Layout) -> torch.Tensor:
    m = st.models[0]
    s = bags.pad(hami_token_logits(st, bags, lay))  # [S * B, T]
    pool = topk_sigmoid_logit if m.bag_score == "sigmoid" else topk_mean
    return seed_topk(pool, s, bags.mask, lay.bags, m.k_ratio)


def pooling(st: Stack, bags: Bags, lay: Layout) -> torch.Tensor:
    m = st.models[0]
    u = st.sequential("feature", m.feature, bags.tokens, lay.tokens)  # [N, D]
    return st.linear("head", m.pool(u, bags), lay.bags).squeeze(-1)  # [S * B, D] -> [S * B]


def raw_pooling(st: Stack, bags: Bags, lay: Layout) -> torch.Tensor:
    m = st.models[0]
    return st.sequential("head", m.head, m.pool(bags.tokens, bags), lay.bags).squeeze(-1)  # [S * B, d] -> [S * B]


def attention(st: Stack, bags: Bags, lay: Layout) -> torch.Tensor:
    m = st.models[0]
    a = per_seed(torch.tanh, st.linear("V", bags.tokens, lay.tokens), lay.tokens)  # [N, L]
    if m.U is not None:
        a = a * per_seed(torch.sigmoid, st.linear("U", bags.tokens, lay.tokens), lay.tokens)
    scores = st.linear("w", a, lay.tokens).squeeze(-1)  # [N]
    weights = segment_softmax(scores, bags, exp=lambda x: per_seed(torch.exp, x, lay.tokens))  # [N]
    v = segment_sum(weights[:, None] * bags.tokens, bags)  # [S * B, d]
    return st.sequential("head", m.head, v, lay.bags).squeeze(-1)


def last_token_probe(st: Stack, bags: Bags, lay: Layout) -> torch.Tensor:
    return st.linear("linear", bags.tokens[bags.last], lay.bags).squeeze(-1)


def token_mlp(st: Stack, bags: Bags, lay: Layout) -> torch.Tensor:
    m = st.models[0]
    return st.sequential("net", m.net, bags.tokens[bags.token_rows(m.index)], lay.bags).squeeze(-1)


# Exact types: a subclass (a plugin's) may change forward, so it is not taken for its parent.
FORWARDS: dict[type, Callable[[Stack, Bags, Layout], torch.Tensor]] = {
    networks.HaMI: hami,
    networks.PoolingNet: pooling,
    networks.RawPoolingNet: raw_pooling,
    networks.AttentionNet: attention,
    networks.LastTokenProbe: last_token_probe,
    networks.TokenMLP: token_mlp,
}


def batchable(model: nn.Module) -> bool:
    """Whether `model` has a batched forward here that computes what its own forward does: one of
    the built-in networks, made of layers this module batches (its Sequentials' layers, and the
    Linear layers the forwards name)."""
    if type(model) not in FORWARDS:
        return False
    for module in model.modules():
        if isinstance(module, nn.Sequential) and not all(type(x) in SEQUENTIAL_LAYERS for x in module):
            return False
        if isinstance(module, nn.BatchNorm1d) and not (module.affine and module.track_running_stats):
            return False
    return True


# ---------------------------------------------------------------------------- losses, per seed
def seed_logistic_losses(z: torch.Tensor, y: torch.Tensor, lay: Layout, pos_weight: float | None) -> torch.Tensor:
    """[S] each seed's logistic_loss over its own bags (z, y [S * B]): the call train_detector
    makes, so a seed's loss and its gradient are the ones it had alone."""
    return torch.stack([logistic_loss(a, b, pos_weight) for a, b in zip(z.split(lay.bags), y.split(lay.bags))])


def seed_mil_losses(st: Stack, bags: Bags, y: torch.Tensor, lay: Layout, params) -> torch.Tensor:
    """[S] training.hami_mil_loss of each seed on its own B bags (B/2 of each class)."""
    n_seeds = len(lay.bags)
    s = per_seed(torch.sigmoid, hami_token_logits(st, bags, lay), lay.tokens)  # [N]
    bag_score = seed_topk(topk_mean, bags.pad(s), bags.mask, lay.bags, params.k_ratio).view(n_seeds, -1)  # [S, B]
    y = y.view(n_seeds, -1)
    if not torch.equal((y == 0).sum(1), (y == 1).sum(1)):
        raise ValueError("the mil loss pairs bags: every seed's batch needs as many correct as hallucinated bags")
    ok, hal = bag_score[y == 0].view(n_seeds, -1), bag_score[y == 1].view(n_seeds, -1)  # [S, B/2], in bag order
    # consecutive tokens of one bag, in bags longer than smooth_min_len (never across bags, so
    # never across seeds)
    same = bags.bag_of_token[1:] == bags.bag_of_token[:-1]  # [N - 1]
    long = bags.lengths[bags.bag_of_token[1:]] > params.smooth_min_len  # [N - 1]
    terms = (s[1:] - s[:-1]) ** 2 * (same & long)  # [N - 1]
    # each seed sums its own N_s - 1 terms, as alone (the pair across two seeds' blocks is 0 and left out)
    ends = np.cumsum(lay.tokens).tolist()
    smooth = torch.stack([terms[end - n : end - 1].sum() for n, end in zip(lay.tokens, ends, strict=True)])  # [S]
    return ((1 - hal**2 + ok**2).sum(1) + params.smoothness * smooth) / ok.shape[1]


# ---------------------------------------------------------------------------- the optimiser
class StackedAdam:
    """torch.optim.Adam's CPU update (its single-tensor path: L2 weight decay added to the gradient,
    no amsgrad, not maximising) on parameters stacked over seeds [S, *shape], with one learning rate
    per seed (`lrs`). Every step of the update is elementwise, so it runs on the whole stack in one
    op, the same arithmetic per element; the last (param += -lr / (1 - beta1^t) * m / denom) takes a
    rate, so it runs per seed when the seeds' rates differ."""

    def __init__(self, params: list[torch.Tensor], lr: float, weight_decay: float, betas=(0.9, 0.999), eps=1e-8):
        self.params, self.weight_decay, self.betas, self.eps = params, weight_decay, betas, eps
        self.lrs = [lr] * len(params[0])
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]
        self.steps = 0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2 = self.betas
        self.steps += 1
        bias_correction1 = 1 - beta1**self.steps
        bias_correction2_sqrt = (1 - beta2**self.steps) ** 0.5
        same_lr = len(set(self.lrs)) == 1
        for p, exp_avg, exp_avg_sq in zip(self.params, self.exp_avg, self.exp_avg_sq, strict=True):
            grad = p.grad
            if self.weight_decay != 0:
                grad = grad.add(p, alpha=self.weight_decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
            if same_lr:
                p.addcdiv_(exp_avg, denom, value=-(self.lrs[0] / bias_correction1))
            else:
                for s, lr in enumerate(self.lrs):
                    p[s].addcdiv_(exp_avg[s], denom[s], value=-(lr / bias_correction1))


# ---------------------------------------------------------------------------- training
def stand_in_plateau(lr: float, kwargs: dict) -> torch.optim.lr_scheduler.ReduceLROnPlateau:
    """ReduceLROnPlateau(mode="min", **kwargs) on a stand-in optimiser holding one seed's rate."""
    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    return torch.optim.lr_scheduler.ReduceLROnPlateau(stand_in, mode="min", **kwargs)


def train_batched(
    method: str,
    method_params,
    train: SplitData,
    val: SplitData,
    seeds: list[int],
    *,
    epochs: int,
    batch_size: int,
    recipe: str | Recipe = "paper",
    trace_gradient_ratio: bool = True,
) -> list[TrainResult]:
    """`train_detector(method, ..., seed=s)` for every s in `seeds`, trained together on the CPU
    (module docstring): one TrainResult per seed, in order. The network must be `batchable`."""
    rec = recipe_of(recipe)
    d = train.tokens.shape[-1]
    models, dropout_gens, batch_gens = [], [], []
    with torch.random.fork_rng(devices=[]):  # the caller's global generator is left as it was
        for seed in seeds:
            torch.manual_seed(seed)
            models.append(build_detector(method, d, method_params))
            dropout = torch.Generator()
            dropout.set_state(torch.get_rng_state())  # where the global generator stood for this seed's dropout
            dropout_gens.append(dropout)
            batch_gens.append(torch.Generator().manual_seed(seed))
    if not batchable(models[0]):
        raise TypeError(f"{method}: its network {type(models[0]).__name__} has no batched form here")
    st = Stack(models, dropout_gens)
    forward = FORWARDS[type(models[0])]
    n_seeds = len(seeds)
    opt = StackedAdam(list(st.params.values()), method_params.lr, method_params.weight_decay)
    mil = getattr(method_params, "loss", "logistic") == "mil"
    samplers = [mil_sampler(rec, train.y, batch_size, g) for g in batch_gens] if mil else None
    pos_weight = None if mil else rec.pos_weight
    drop_last = rec.drop_last and not mil
    check_recipe(rec, method_params, len(train), batch_size)
    # ReduceLROnPlateau per seed, each on a stand-in optimiser whose one learning rate is that seed's:
    # on the validation loss after every epoch (logistic), or on the training loss after every step (MIL)
    plateaus = step_plateaus = None
    if rec.plateau and not mil:
        plateaus = [stand_in_plateau(method_params.lr, rec.plateau) for _ in seeds]
    if rec.mil_plateau and mil:
        step_plateaus = [stand_in_plateau(method_params.lr, rec.mil_plateau) for _ in seeds]
    results = [TrainResult({}, 0, -1.0, []) for _ in seeds]
    val_y, train_y = val.y.numpy(), train.y.numpy()
    traces = [None] * n_seeds
    if trace_gradient_ratio:
        first = GradientRatioTrace.for_training(models[0], train)
        if first is not None:  # the traced bags and their Gram matrices are the same for every seed
            traces = [first] + [GradientRatioTrace.sharing(first) for _ in seeds[1:]]
    for epoch in range(1, epochs + 1):
        lrs = list(opt.lrs)
        totals, n = np.zeros(n_seeds), 0
        if mil:
            steps = zip(*(sampler.epoch() for sampler in samplers), strict=True)
        else:
            steps = zip(*(epoch_batches(len(train), batch_size, g, drop_last) for g in batch_gens), strict=True)
        for batches in steps:  # one batch of B bags per seed
            index = torch.cat(batches)  # [S * B] seed after seed
            bags, y = train.bags(index), train.y[index]
            lay = Layout(bags.lengths.view(n_seeds, -1).sum(1).tolist(), [len(b) for b in batches])
            if mil:
                losses = seed_mil_losses(st, bags, y, lay, method_params)
            else:
                losses = seed_logistic_losses(forward(st, bags, lay), y, lay, pos_weight)
            opt.zero_grad()
            losses.sum().backward()  # a seed's slice of each gradient is its own loss's gradient
            opt.step()
            if step_plateaus is not None:
                for i, (sched, loss) in enumerate(zip(step_plateaus, losses, strict=True)):
                    sched.step(loss.item())
                    opt.lrs[i] = sched.optimizer.param_groups[0]["lr"]
            totals += np.asarray([loss.item() for loss in losses]) * lay.bags  # as train_detector sums them
            n += lay.bags[0]  # the same number of bags for every seed
        for s, res in enumerate(results):
            model = st.load(s)
            val_z = score(model, val)
            val_auroc = float(auroc(val_y, val_z))
            row = {"epoch": epoch, "train_loss": totals[s] / n, "val_auroc": val_auroc, "lr": lrs[s]}
            row |= epoch_margins(train_y, score(model, train), val_y, val_z)
            if plateaus is not None:
                row["val_loss"] = float(logistic_loss(torch.from_numpy(val_z), val.y, pos_weight))
                plateaus[s].step(row["val_loss"])
                opt.lrs[s] = plateaus[s].optimizer.param_groups[0]["lr"]
            res.curve.append(row)
            if val_auroc > res.best_val_auroc:
                res.best_val_auroc, res.best_epoch = val_auroc, epoch
                res.state_dict = st.state_dict(s)
            if traces[s] is not None:
                traces[s].record(epoch, model)
    for s, res in enumerate(results):
        res.last_state_dict = st.state_dict(s)
        if traces[s] is not None:
            res.gradient_ratio = traces[s].result(res.best_epoch)
    return results
