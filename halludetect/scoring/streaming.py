"""A served answer streamed as it is sampled, with the detector's running score (`halludetect serve`,
`stream: true`; scoring/serve.py sends the chunks).

The model thread samples a round of requests in one batched `generate` (scoring/serve.py). For the
rows of streamed requests, `RoundStream` hands transformers a streamer, which sees every step's
tokens, and a stopping criterion, which ends the rows of a request whose client has gone (its slot
is freed at once; the row stops at the next step). Each row's tokens go through `RowText`, which
passes on only what the finished answer will hold, so that the chunks' texts concatenate to the
answer a request without `stream` gets (the same seed: the same answer):

- a token that ends the answer (an end-of-text token, or the one completing a stop string) is never
  sent, as the answer's trimming drops it (lm/generation.py, `trim_answer`);
- leading and trailing whitespace is held back (the answer is stripped): what follows it sends it;
- the bytes of a character spelled over several tokens are held until it is whole.

The running score, after each sent token: the detector on the answer so far, i.e. its bag of the
states the sampling pass computed up to there (activations/sampled_states.py keeps them). For the
paper's max and mean pooling networks it is kept, not recomputed (`RunningPool`): each new state goes
through every seed's feature layer at once, into the element-wise max (or sum) so far, under the
heads: one small product per token. For attention, HaMI's top-k and the probes it is the same
network on the bag so far. With `generated` positions the state of a
token is computed with the next one, so that convention's running score is one token behind. The
last chunk carries the answer's own `hallucination` object, computed as without `stream`.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from halludetect.activations.bags import Bags
from halludetect.detectors import networks
from halludetect.detectors.pooling import segment_max, segment_mean


@dataclass
class Chunk:
    """What one step adds to one streamed choice."""

    choice: int
    text: str
    token_ids: list[int]
    running_score: float | None  # the detector on the answer so far; None before it can score one


class RowText:
    """One streamed answer: its tokens as they come, and the text that is certain to be the answer's."""

    def __init__(self, tokenizer, stop: list[str], ends: set[int]):
        self.tokenizer, self.stop, self.ends = tokenizer, stop, ends
        self.ids: list[int] = []  # the answer's tokens so far (never one that ends it)
        self.sent = ""  # the text sent so far: always a prefix of the answer's
        self.unsent: list[int] = []  # tokens taken since the last text sent
        self.done = False

    def push(self, token: int) -> tuple[str, list[int]] | None:
        """Take the next sampled token: (text, tokens) to send, or None (nothing certain yet, or the end)."""
        if self.done:
            return None
        if token in self.ends:
            self.done = True
            return None
        text = self.tokenizer.decode([*self.ids, token], skip_special_tokens=True)
        if self.stop and any(s in text for s in self.stop):  # this token completes a stop string: dropped
            self.done = True
            return None
        self.ids.append(token)
        self.unsent.append(token)
        certain = text.strip().rstrip("\ufffd").rstrip()  # whitespace and a half-spelled character held back
        if len(certain) <= len(self.sent) or not certain.startswith(self.sent):
            return None
        delta, self.sent = certain[len(self.sent) :], certain
        ids, self.unsent = self.unsent, []
        return delta, ids

    def rest(self, answer: str, answer_ids: list[int]) -> tuple[str, list[int]]:
        """What the last chunk adds: the finished answer beyond what was sent (text and tokens)."""
        if not answer.startswith(self.sent):  # cannot happen (the text sent is the answer's); said, not hidden
            raise RuntimeError(f"streamed text {self.sent!r} is not a prefix of the answer {answer!r}")
        sent_ids = len(self.ids) - len(self.unsent)
        return answer[len(self.sent) :], answer_ids[sent_ids:]


class RunningPool:
    """The bundle's seeds of a max or mean pooling network (networks.PoolingNet, feature Linear-ReLU-
    Dropout), their running score kept per row: every seed's feature layer stacked into one
    [S * D, d] product, the pooled vector so far per row (max, or sum and count), the heads after it.
    The same arithmetic as the network's forward on the bag so far, to float rounding."""

    def __init__(self, nets: list[networks.PoolingNet]):
        self.weight = torch.cat([n.feature[0].weight for n in nets]).T.contiguous().detach()  # [d, S * D]
        self.bias = torch.cat([n.feature[0].bias for n in nets]).detach()  # [S * D]
        # the seeds' mean logit, mean_s (v_s . w_s + b_s), is one product: v . (w / S) + mean(b)
        self.head = (torch.cat([n.head.weight[0] for n in nets]) / len(nets)).detach()  # [S * D]
        self.head_bias = torch.cat([n.head.bias for n in nets]).mean().detach()  # []
        self.max = nets[0].pool is segment_max

    @classmethod
    def of(cls, bundle) -> RunningPool | None:
        """For a bundle whose every seed is such a network (exactly: a subclass may differ), else None."""
        nets = [bundle.detectors[s] for s in bundle.seeds]
        for n in nets:
            if type(n) is not networks.PoolingNet or n.pool not in (segment_max, segment_mean):
                return None
            kinds = [type(m) for m in n.feature]
            if kinds != [torch.nn.Linear, torch.nn.ReLU, networks.Dropout]:
                return None
        return cls(nets)

    def add(self, pooled: dict, h: torch.Tensor) -> float:
        """Take the states h [n, d] into a row's pooled values (`pooled`, kept by the caller); its score."""
        return self.add_rows([pooled], h, [len(h)])[0]

    def add_rows(self, pooled: list[dict], h: torch.Tensor, counts: list[int]) -> list[float]:
        """Take each row's new states into its pooled values, all rows in one product: h [N, d] holds
        row i's `counts[i]` (>= 1) states in turn; each row's score. A step of R streamed rows is a
        fixed handful of tensor operations, not a handful per row."""
        with torch.no_grad():
            u = torch.addmm(self.bias, h.to(self.weight), self.weight).relu_()  # [N, S * D], >= 0
            if max(counts) == 1:  # a state per row: the usual step
                part = u  # [R, S * D]
            elif self.max:
                part = torch.stack([x.max(0).values for x in u.split(counts)])
            else:
                part = torch.stack([x.sum(0) for x in u.split(counts)])
            before = [p.get("v") for p in pooled]
            if all(b is None for b in before):  # the rows' first states (a row's first token, say)
                v = part
            else:  # zeros stand for no state: u >= 0, so they are neutral to the max as to the sum
                old = torch.stack([torch.zeros_like(self.bias) if b is None else b for b in before])  # [R, S * D]
                v = torch.maximum(old, part) if self.max else old + part
            rows = v.unbind(0)
            for p, row, c in zip(pooled, rows, counts):
                p["v"], p["n"] = row, p.get("n", 0) + c
            if not self.max:  # the mean so far: the sums over the counts
                v = v / torch.tensor([p["n"] for p in pooled], dtype=v.dtype)[:, None]
            return torch.addmv(self.head_bias, v, self.head).tolist()  # [R]


@dataclass
class StreamedRow:
    """A round row that is streamed: where its chunks go, and what it has sent."""

    choice: int
    events: queue.Queue  # Chunk, then the model thread's end of round (None)
    cancelled: threading.Event
    text: RowText
    states: list[torch.Tensor] = field(default_factory=list)  # [d] the state at column W - 1 + j, j = 0, 1, ...
    pooled: dict = field(default_factory=dict)  # RunningPool's values so far
    fed: int = 0  # states taken into `pooled`


class RoundStream:
    """The streamed rows of one round (round row -> StreamedRow), as `sample_with_states`'s `stream`.

    `score` is the detector on a batch of bags ([B] logits; None: no running score, the answers
    alone), `positions` the bundle's bag convention, `min_tokens` the fewest tokens it scores,
    `states_dtype` the dtype the dump stores (a bag's values are read as the dump's)."""

    def __init__(
        self, rows: dict[int, StreamedRow], score, positions: str, min_tokens: int, states_dtype, running=None
    ):
        self.streamed, self.score, self.running = rows, score, running  # running: a RunningPool, or None
        self.positions, self.min_tokens, self.states_dtype = positions, min_tokens, states_dtype
        self.index: list[int] | None = None  # None: the round's own rows, in order

    def row_of(self, r: int) -> int:
        """The round row of this stream's row r."""
        return r if self.index is None else self.index[r]

    def rows(self, index: list[int]) -> RoundStream:
        """The same stream over rows `index` of this one's rows."""
        view = RoundStream.__new__(RoundStream)
        view.__dict__ = dict(self.__dict__)
        view.index = [self.row_of(i) for i in index]
        return view

    def call(self, width: int, steps: list[torch.Tensor]):
        """The streamer and the stopping criterion of one `generate` over this stream's rows. A row
        sampled again (its answer was empty: nothing of it was sent) starts over."""
        rows = self.streamed.values() if self.index is None else [self.streamed.get(g) for g in self.index]
        for row in rows:
            if row is not None:
                row.text = RowText(row.text.tokenizer, row.text.stop, row.text.ends)
                row.states.clear()
                row.pooled, row.fed = {}, 0
        return _Streamer(self, steps), _Cancelled(self)

    # ------------------------------------------------------------------ one step
    def step(self, tokens: list[int], steps: list[torch.Tensor]) -> None:
        """Each streamed row's next token: its state kept, its certain text sent with the running score."""
        sent: list[tuple[StreamedRow, tuple[str, list[int]]]] = []
        # [R] views of [d]: each row's state at the forward that gave these tokens (one op, not one per row)
        last = steps[-1][:, -1].unbind(0) if steps else None
        for r, token in enumerate(tokens):
            row = self.streamed.get(self.row_of(r))
            if row is None or row.text.done:
                continue
            if last is not None:
                row.states.append(last[r])
            out = row.text.push(token)
            if out is not None:
                sent.append((row, out))
        scores = self._running([row for row, _ in sent]) if sent else {}
        for row, (text, ids) in sent:
            row.events.put(Chunk(row.choice, text, ids, scores.get(id(row))))

    def _running(self, rows: list[StreamedRow]) -> dict[int, float]:
        """The detector on each row's answer so far, where its bag is there and long enough."""
        if self.score is None:
            return {}
        lag = 1 if self.positions == "generated" else 0  # a token's own state comes with the next one
        if self.running is not None:  # the step's new states of every row in one stack and one product
            feed, states, counts = [], [], []
            for row in rows:
                k = min(len(row.text.ids), len(row.states) - lag)  # the tokens whose states are there
                if k > row.fed:
                    feed.append(row)
                    states += row.states[row.fed + lag : k + lag]
                    counts.append(k - row.fed)
                    row.fed = k
            if feed:
                h = torch.stack(states).to(self.states_dtype).float()  # [N, d]
                for row, z in zip(feed, self.running.add_rows([r.pooled for r in feed], h, counts), strict=True):
                    row.pooled["z"] = z
            return {id(row): row.pooled["z"] for row in rows if row.fed >= max(1, self.min_tokens)}
        bags, which = [], []
        for row in rows:
            k = min(len(row.text.ids), len(row.states) - lag)  # the tokens whose states are there
            if k >= max(1, self.min_tokens):
                bags.append(torch.stack(row.states[lag : k + lag]))
                which.append(row)
        if not bags:
            return {}
        tokens = torch.cat(bags).to(self.states_dtype).float()  # [N, d]
        lengths = torch.tensor([len(b) for b in bags], dtype=torch.int64, device=tokens.device)
        with torch.no_grad():
            z = self.score(Bags(tokens, lengths)).double().cpu().tolist()  # [B]
        return {id(row): float(v) for row, v in zip(which, z, strict=True)}


class _Streamer(BaseStreamer):
    def __init__(self, stream: RoundStream, steps: list[torch.Tensor]):
        self.stream, self.steps, self.prompt_seen = stream, steps, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate hands over the prompts [R, W] first
            self.prompt_seen = True
            return
        self.stream.step(value.reshape(-1).tolist(), self.steps)

    def end(self) -> None:
        pass


class _Cancelled(StoppingCriteria):
    """Ends the rows of requests whose client has gone (the others go on as they were)."""

    def __init__(self, stream: RoundStream):
        self.stream = stream

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        gone = []
        for r in range(input_ids.shape[0]):
            row = self.stream.streamed.get(self.stream.row_of(r))
            gone.append(row is not None and row.cancelled.is_set())
        return torch.tensor(gone, dtype=torch.bool, device=input_ids.device)
