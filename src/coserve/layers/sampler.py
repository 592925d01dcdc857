"""Turns one step's logits into next tokens: greedy, temperature, top-k, top-p, seeds, logprobs.

The semantics follow vLLM. Each row of the logits belongs to one sequence that samples this step:

1. ``min_tokens``: while a request has generated fewer than ``min_tokens`` tokens, its EOS ids
   and its ``stop_token_ids`` get ``-inf``, before anything else.
2. Logit processing (:attr:`SamplingParams.processes_logits`): ``logit_bias`` added, then the
   repetition penalty over the prompt's and the output's tokens, then the frequency and presence
   penalties over the output's.
3. Greedy rows (``params.greedy``) take the argmax.
4. Sampled rows divide by the temperature, keep the top-k, then the top-p nucleus, then the
   ``min_p`` set, and draw from
   the softmax of what is left with the exponential race (Gumbel-max): ``argmax(p / q)`` with
   ``q ~ Exp(1)`` drawn per row, which is an exact draw from ``p``. A seeded request draws its
   ``q`` only from its own generator, so its tokens do not depend on the rest of the batch or on
   its row; unseeded rows share the sampler's global generator.
5. Log-probabilities, when asked for, come from the raw logits (before min_tokens, biases,
   penalties, temperature, top-k, top-p and min_p), as vLLM reports them by default.

Ties at a filter boundary are kept: top-k keeps every token whose logit equals the k-th largest
(as vLLM's top-k does), and top-p keeps every token tied with the least probable token of the
nucleus, so the kept set never depends on how a sort orders equal values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from coserve.engine.sampling_params import SampledToken, SamplingParams

__all__ = ["Sampler"]


class Sampler:
    """Picks one token per logits row; holds the global generator for unseeded requests.

    The global generator is seeded with ``seed`` and made lazily on each device that logits
    arrive on (one generator per device), so the same sampler works on CPU and CUDA.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def global_generator(self, device: torch.device) -> torch.Generator:
        """The shared generator for unseeded rows on ``device``, created on first use."""
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        num_generated: Sequence[int],
        eos_token_ids: frozenset[int],
        token_ids: Callable[[int], tuple[Sequence[int], Sequence[int]]] | None = None,
    ) -> list[SampledToken]:
        """Sample one token per row.

        Args:
            logits: ``[R, V]`` floating-point logits, one row per sequence sampling this step;
                any float dtype (computation is in fp32), on any device. Not modified.
            params: ``R`` sampling settings, row-aligned with ``logits``.
            generators: ``R`` entries: the request's own generator (seeded request) or ``None``
                to use the sampler's global generator. A generator on another device than
                ``logits`` works but costs a copy; keep them on the logits' device.
            num_generated: ``R`` counts of tokens each request has generated so far.
            eos_token_ids: ids that end generation; masked, together with the request's
                ``stop_token_ids``, while ``num_generated < params.min_tokens``. Ids outside
                ``[0, V)`` are ignored (they cannot be sampled anyway).
            token_ids: row ``i`` -> its (prompt token ids, output token ids), which the
                penalties count; called only for the rows whose params have a penalty.

        Returns:
            ``R`` :class:`SampledToken`, row-aligned. ``logprob`` and ``top_logprobs`` are set
            only for rows whose ``params.logprobs`` is not ``None``: ``logprob`` is the raw
            log-softmax of the chosen token and ``top_logprobs`` maps the ``params.logprobs``
            most likely token ids to their raw log-probabilities, most likely first.
        """
        if logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(
                f"logits must be a 2-D float tensor, got {tuple(logits.shape)} {logits.dtype}"
            )
        num_rows, vocab = logits.shape
        if not len(params) == len(generators) == len(num_generated) == num_rows:
            raise ValueError(
                f"need one params/generator/num_generated per logits row ({num_rows}), got "
                f"{len(params)}/{len(generators)}/{len(num_generated)}"
            )
        if num_rows == 0:
            return []
        device = logits.device
        raw = logits.float()  # may alias ``logits`` when already fp32: never modify it in place
        x = _mask_min_tokens(raw, params, num_generated, eos_token_ids)
        if any(p.processes_logits for p in params):
            x = _process_logits(x.clone() if x is raw else x, params, token_ids)

        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(sampled_rows) < num_rows:
            # One argmax over every row is as cheap as gathering the greedy rows first; the
            # sampled rows' entries are overwritten below.
            tokens = x.argmax(dim=-1)
        else:
            tokens = torch.empty(num_rows, dtype=torch.long, device=device)
        if sampled_rows:
            s_idx = torch.tensor(sampled_rows, device=device)
            s_params = [params[i] for i in sampled_rows]
            s_gens = [generators[i] for i in sampled_rows]
            # index_select copies, so _sample may work in place without touching ``logits``.
            sampled = self._sample(x.index_select(0, s_idx), s_params, s_gens)
            tokens.index_copy_(0, s_idx, sampled)

        token_list: list[int] = tokens.tolist()
        logprobs = _logprobs(raw, tokens, params)
        out: list[SampledToken] = []
        for i, tok in enumerate(token_list):
            if i in logprobs:
                lp, top = logprobs[i]
                out.append(SampledToken(token_id=tok, logprob=lp, top_logprobs=top))
            else:
                out.append(SampledToken(token_id=tok))
        return out

    def _sample(
        self,
        x: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """Draw one token per row of ``x`` (``[S, V]`` fp32, owned) -> ``[S]`` int64 ids."""
        num_rows, vocab = x.shape
        device = x.device
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        # (a temperature past float32's range would be inf there, and -inf / inf a NaN that argmax
        # picks: a filtered token, an EOS under min_tokens, drawn; float32's largest keeps them -inf)
        x.div_(temps.clamp_(max=torch.finfo(torch.float32).max).unsqueeze(1))
        x = _apply_top_k_top_p(x, params)
        x = _apply_min_p(x, params)

        q = torch.empty_like(x)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            # Unseeded rows need no per-row stream: one draw for all of them.
            gen = self.global_generator(device)
            if len(unseeded) == num_rows:
                q.exponential_(generator=gen)
            else:
                block = torch.empty(len(unseeded), vocab, device=device).exponential_(generator=gen)
                q.index_copy_(0, torch.tensor(unseeded, device=device), block)
        for i, g in enumerate(generators):
            if g is None:
                continue
            if g.device == device:
                q[i].exponential_(generator=g)
            else:
                q[i].copy_(torch.empty(vocab, device=g.device).exponential_(generator=g))
        # exponential_ can return exactly 0; clamping keeps log(q) finite so -inf (filtered)
        # logits stay -inf instead of becoming NaN.
        q.clamp_(min=torch.finfo(torch.float32).tiny)
        # argmax(softmax(x) / q) == argmax(x - log q), without softmax underflow of small probs.
        return x.sub_(q.log_()).argmax(dim=-1)


def _mask_min_tokens(
    raw: torch.Tensor,
    params: Sequence[SamplingParams],
    num_generated: Sequence[int],
    eos_token_ids: frozenset[int],
) -> torch.Tensor:
    """Return fp32 logits (``[R, V]``) with EOS/stop ids at ``-inf`` for rows under min_tokens.

    Returns ``raw`` itself when nothing is masked (so the result may alias the caller's logits and
    must not be modified in place), otherwise a masked copy.
    """
    vocab = raw.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, (p, n) in enumerate(zip(params, num_generated, strict=True)):
        if n < p.min_tokens:
            # A stop id is user input and may lie outside the vocab; such ids cannot be sampled,
            # and indexing with them would fail the whole batch.
            banned = {t for t in eos_token_ids | set(p.stop_token_ids) if 0 <= t < vocab}
            rows.extend([i] * len(banned))
            cols.extend(banned)
    if not rows:
        return raw
    index = torch.tensor([rows, cols], device=raw.device)
    return raw.index_put((index[0], index[1]), torch.tensor(float("-inf"), device=raw.device))


def _process_logits(x: torch.Tensor, params: Sequence[SamplingParams],
                    token_ids: Callable[[int], tuple[Sequence[int], Sequence[int]]] | None) -> torch.Tensor:
    """Each processing row's bias and penalties (module docstring, step 2), in place on ``x``
    (``[R, V]`` fp32, owned). Bias ids outside ``[0, V)`` are ignored (the engine refuses them)."""
    vocab, device = x.shape[1], x.device
    for i, p in enumerate(params):
        if not p.processes_logits:
            continue
        row = x[i]
        if p.logit_bias:
            ids = [t for t, _ in p.logit_bias if t < vocab]
            bias = [b for t, b in p.logit_bias if t < vocab]
            if ids:
                row.index_add_(0, torch.tensor(ids, device=device), torch.tensor(bias, device=device))
        if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
            continue
        if token_ids is None:
            raise ValueError("a row with a penalty needs its token ids (token_ids)")
        prompt, output = token_ids(i)
        out = torch.tensor(list(output), dtype=torch.long, device=device)
        if p.repetition_penalty != 1.0:
            seen = torch.cat([torch.tensor(list(prompt), dtype=torch.long, device=device), out]).unique()
            seen = seen[seen < vocab]
            v = row.index_select(0, seen)
            row.index_copy_(0, seen, torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty))
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and out.numel():
            counts = torch.bincount(out[out < vocab], minlength=vocab).to(row.dtype)
            row.sub_(counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty)
    return x


def _apply_min_p(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set logits of tokens less than ``min_p`` times as likely as the row's most likely one to
    ``-inf`` (``x``: ``[S, V]`` fp32 scaled and filtered logits, modified in place and returned)."""
    if not any(p.min_p > 0.0 for p in params):
        return x
    min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype, device=x.device)
    # p_i >= min_p · p_max  <=>  x_i >= x_max + log(min_p)  (min_p = 0: log 0 = -inf keeps all)
    floor = x.amax(dim=1) + min_p.log()
    return x.masked_fill_(x < floor.unsqueeze(1), float("-inf"))


def _apply_top_k_top_p(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set logits outside each row's top-k set, then outside its top-p nucleus, to ``-inf``.

    ``x`` is ``[S, V]`` fp32 temperature-scaled logits, modified in place and returned.
    Top-k keeps the tokens whose logit is >= the k-th largest (``k <= 0`` keeps all). Top-p then
    renormalizes over the kept tokens and keeps a token iff the probability mass of the tokens
    strictly more likely than it is < ``top_p``: without ties that is the smallest most-likely set
    reaching ``top_p``; the most likely token is always kept.
    """
    vocab = x.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    need_k = any(k < vocab for k in ks)
    need_p = any(p.top_p < 1.0 for p in params)
    if not (need_k or need_p):
        return x
    device = x.device
    k_idx = torch.tensor(ks, device=device).sub_(1).unsqueeze(1)  # [S, 1] position of k-th

    if not need_p:
        # Top-k alone only needs the largest max(k) values, not a full sort.
        top_vals = x.topk(max(ks), dim=-1).values
        x.masked_fill_(x < top_vals.gather(1, k_idx), float("-inf"))
        return x

    sorted_vals = x.sort(dim=-1, descending=True).values
    if need_k:
        k_thresh = sorted_vals.gather(1, k_idx)
        x.masked_fill_(x < k_thresh, float("-inf"))
        sorted_vals.masked_fill_(sorted_vals < k_thresh, float("-inf"))
    probs = sorted_vals.softmax(dim=-1)
    # Mass of the tokens before each sorted position (exclusive cumsum, shifted rather than
    # cumsum - probs so it stays monotone); it is 0 at position 0, so the top token survives.
    mass_before = torch.zeros_like(probs)
    mass_before[:, 1:] = probs[:, :-1].cumsum(dim=-1)
    # Rows without top-p get a bound above any rounded mass, so rounding never drops a token.
    top_p = torch.tensor(
        [p.top_p if p.top_p < 1.0 else 2.0 for p in params], dtype=torch.float32, device=device
    )
    # (clamped: a top_p below float32's smallest number rounds to 0, which no mass is below; the
    # top token is kept then, as for any top_p smaller than its probability)
    last_kept = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).sub_(1).clamp_(min=0)
    # Comparing against the logit of the last kept position also keeps tokens tied with it.
    x.masked_fill_(x < sorted_vals.gather(1, last_kept), float("-inf"))
    return x


def _logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]
) -> dict[int, tuple[float, dict[int, float]]]:
    """Raw log-probabilities for the rows that ask for them.

    ``raw`` is ``[R, V]`` fp32 raw logits, ``tokens`` ``[R]`` the chosen ids. Returns
    ``{row: (logprob of the chosen token, {token_id: logprob} of the top n, most likely first)}``.
    """
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return {}
    device = raw.device
    idx = torch.tensor(rows, device=device)
    lp = torch.log_softmax(raw.index_select(0, idx), dim=-1)
    chosen: list[float] = lp.gather(1, tokens.index_select(0, idx).unsqueeze(1)).squeeze(1).tolist()
    ns = [params[i].logprobs or 0 for i in rows]
    max_n = max(ns)
    top_vals: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if max_n > 0:
        top = lp.topk(min(max_n, lp.shape[1]), dim=-1)  # sorted, most likely first
        top_vals = top.values.tolist()
        top_ids = top.indices.tolist()
    return {
        row: (chosen[j], dict(zip(top_ids[j][: ns[j]], top_vals[j][: ns[j]], strict=True)))
        for j, row in enumerate(rows)
    }
