"""Sampler: greedy, temperature, top-k/top-p/min-p kept sets, seeds, min_tokens, logit bias and penalties,
logprobs, dtypes."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
import torch

from coserve.engine.sampling_params import SampledToken, SamplingParams
from coserve.layers.sampler import Sampler, _apply_top_k_top_p

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

GREEDY = SamplingParams(temperature=0.0)


def _call(
    sampler: Sampler,
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    num_generated: list[int] | None = None,
    eos: frozenset[int] = frozenset(),
) -> list[SampledToken]:
    rows = logits.shape[0]
    return sampler(
        logits,
        params,
        generators if generators is not None else [None] * rows,
        num_generated if num_generated is not None else [0] * rows,
        eos,
    )


def _ids(tokens: list[SampledToken]) -> list[int]:
    return [t.token_id for t in tokens]


def _gen(seed: int, device: str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


# Plain references, in float64 Python, written for obviousness rather than speed.


def _ref_softmax(logits: list[float]) -> list[float]:
    finite = [x for x in logits if x != -math.inf]
    top = max(finite)
    exps = [math.exp(x - top) if x != -math.inf else 0.0 for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def _ref_kept(logits: list[float], temperature: float, top_k: int, top_p: float) -> set[int]:
    """Token ids surviving top-k then top-p, ties at either boundary all kept."""
    scaled = [x / temperature for x in logits]
    kept = set(range(len(scaled)))
    if 0 < top_k < len(scaled):
        kth = sorted(scaled, reverse=True)[top_k - 1]
        kept = {i for i in kept if scaled[i] >= kth}
    if top_p < 1.0:
        probs = _ref_softmax([scaled[i] if i in kept else -math.inf for i in range(len(scaled))])
        # Keep a token iff the tokens strictly more likely than it hold less than top_p.
        kept = {i for i in kept if sum(probs[j] for j in kept if scaled[j] > scaled[i]) < top_p}
    return kept


def _kept_by_sampler(logits: list[float], params: SamplingParams) -> set[int]:
    x = torch.tensor([logits], dtype=torch.float32) / params.temperature
    out = _apply_top_k_top_p(x, [params])
    return {i for i, v in enumerate(out[0].tolist()) if v != -math.inf}


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device: str) -> None:
    logits = torch.randn(7, 50, generator=_gen(0)).to(device)
    out = _call(Sampler(), logits, [GREEDY] * 7)
    assert _ids(out) == logits.argmax(dim=-1).tolist()
    assert all(t.logprob is None and t.top_logprobs == {} for t in out)


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_1_equals_greedy(device: str) -> None:
    logits = torch.randn(16, 100, generator=_gen(1)).to(device)
    params = [SamplingParams(temperature=t, top_k=1) for t in (0.3, 1.0, 2.5, 10.0)] * 4
    gens: list[torch.Generator | None] = [None, _gen(5, device)] * 8
    for _ in range(3):
        assert _ids(_call(Sampler(), logits, params, gens)) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_independent_of_batch_and_position(device: str) -> None:
    vocab = 32
    row = torch.randn(vocab, generator=_gen(2)) * 0.5  # flat enough that draws vary
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    alone_gen = _gen(1234, device)
    alone = [
        _call(Sampler(seed=7), row.unsqueeze(0).to(device), [params], [alone_gen])[0].token_id
        for _ in range(20)
    ]

    others = torch.randn(5, vocab, generator=_gen(3))
    others[3] = row
    batch = others.to(device)
    batch_params = [
        SamplingParams(temperature=1.3),
        GREEDY,
        SamplingParams(temperature=0.5, top_k=4, seed=9),
        params,
        SamplingParams(temperature=1.0),
    ]
    batch_gen = _gen(1234, device)
    sampler = Sampler(seed=99)  # a different global stream must not matter either
    in_batch = []
    for step in range(20):
        gens: list[torch.Generator | None] = [None, None, _gen(step, device), batch_gen, None]
        in_batch.append(_call(sampler, batch, batch_params, gens)[3].token_id)

    assert in_batch == alone
    assert len(set(alone)) > 1  # the comparison means something only if the draws vary


def test_unseeded_rows_follow_sampler_seed() -> None:
    logits = torch.zeros(8, 1000)
    params = [SamplingParams()] * 8
    a = _ids(_call(Sampler(seed=3), logits, params))
    b = _ids(_call(Sampler(seed=3), logits, params))
    c = _ids(_call(Sampler(seed=4), logits, params))
    assert a == b
    assert a != c


@pytest.mark.parametrize("device", DEVICES)
def test_empirical_distribution_matches_softmax(device: str) -> None:
    logits = torch.tensor([1.0, 0.2, -0.5, 0.9, -2.0, 0.0])
    draws = 20_000
    out = _call(
        Sampler(seed=0),
        logits.expand(draws, -1).to(device),
        [SamplingParams(temperature=0.7)] * draws,
    )
    counts = Counter(_ids(out))
    expected = torch.softmax(logits / 0.7, dim=-1).tolist()
    for tok, p in enumerate(expected):
        # 4.5 standard deviations of a binomial proportion: a false failure is ~1e-5 likely.
        assert abs(counts[tok] / draws - p) < 4.5 * math.sqrt(p * (1 - p) / draws), (tok, p)


def test_seeded_generator_distribution_matches_softmax() -> None:
    logits = torch.tensor([[0.5, -0.3, 0.1, 1.2]])
    params = [SamplingParams(temperature=1.5, seed=0)]
    gen = _gen(0)
    sampler = Sampler()
    draws = 3000
    counts = Counter(_call(sampler, logits, params, [gen])[0].token_id for _ in range(draws))
    expected = torch.softmax(logits[0] / 1.5, dim=-1).tolist()
    for tok, p in enumerate(expected):
        assert abs(counts[tok] / draws - p) < 4.5 * math.sqrt(p * (1 - p) / draws), (tok, p)


def test_filtered_distribution_is_renormalized() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.8)
    kept = _ref_kept(logits.tolist(), 1.0, 4, 0.8)
    assert kept == {0, 1, 2}
    draws = 20_000
    counts = Counter(_ids(_call(Sampler(), logits.expand(draws, -1), [params] * draws)))
    assert set(counts) == kept
    probs = _ref_softmax([x if i in kept else -math.inf for i, x in enumerate(logits.tolist())])
    for tok in kept:
        p = probs[tok]
        assert abs(counts[tok] / draws - p) < 4.5 * math.sqrt(p * (1 - p) / draws), (tok, p)


# (logits, temperature, top_k, top_p, expected kept set)
HAND_CASES = [
    ([3.0, 1.0, 2.0, 2.0, 0.0], 1.0, 2, 1.0, {0, 2, 3}),  # tie at the k-th place: both kept
    ([1.0, 1.0, 1.0, 1.0], 1.0, 3, 1.0, {0, 1, 2, 3}),  # all tied
    ([0.0, 5.0, 1.0, 4.0], 1.0, 2, 1.0, {1, 3}),
    ([0.0, 5.0, 1.0, 4.0], 1.0, 10, 1.0, {0, 1, 2, 3}),  # k > V keeps all
    ([0.0, 5.0, 1.0, 4.0], 1.0, -1, 1.0, {0, 1, 2, 3}),  # -1 disables
    ([2.0, 1.0, 1.0, 0.0], 1.0, 0, 0.6, {0, 1, 2}),  # tie at the nucleus edge: both kept
    ([2.0, 1.0, 1.0, 0.0], 1.0, 0, 0.5, {0}),  # top token alone already reaches p
    ([1.0, 1.0, 0.0], 1.0, 0, 0.1, {0, 1}),  # tie for the top token
    ([0.0, 3.0, 1.0], 1.0, 0, 1e-6, {1}),  # tiny p: the top token always survives
    ([4.0, 3.0, 2.0, 1.0, 0.0], 1.0, 0, 0.9, {0, 1, 2}),
    ([4.0, 3.0, 2.0, 1.0, 0.0], 1.0, 3, 0.9, {0, 1}),  # top-p renormalizes after top-k
    ([1.0, 0.5, 0.0, -0.5], 1.0, 0, 0.75, {0, 1, 2}),
    ([1.0, 0.5, 0.0, -0.5], 0.25, 0, 0.75, {0}),  # low temperature sharpens the nucleus
]


@pytest.mark.parametrize(("logits", "temperature", "top_k", "top_p", "expected"), HAND_CASES)
def test_top_k_top_p_kept_set_hand_cases(
    logits: list[float], temperature: float, top_k: int, top_p: float, expected: set[int]
) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    assert _ref_kept(logits, temperature, top_k, top_p) == expected
    assert _kept_by_sampler(logits, params) == expected

    # And nothing outside the kept set is ever drawn.
    draws = 2000
    batch = torch.tensor(logits).expand(draws, -1)
    drawn = set(_ids(_call(Sampler(), batch, [params] * draws)))
    assert drawn <= expected
    assert drawn == expected  # every kept token here is likely enough to show up in 2000 draws


def test_top_k_top_p_kept_set_random_cases() -> None:
    gen = _gen(11)
    checked = 0
    for _ in range(300):
        vocab = int(torch.randint(2, 12, (1,), generator=gen))
        # Small integer logits make ties common.
        logits = torch.randint(-3, 4, (vocab,), generator=gen).float().tolist()
        top_k = int(torch.randint(-1, vocab + 2, (1,), generator=gen))
        top_p = float(torch.rand((), generator=gen)) * 0.98 + 0.02
        temperature = [0.5, 1.0, 2.0][int(torch.randint(0, 3, (1,), generator=gen))]
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        # Skip draws whose nucleus edge sits within fp32 rounding of top_p.
        after_k = _ref_kept(logits, temperature, top_k, 1.0)
        masked = [x / temperature if i in after_k else -math.inf for i, x in enumerate(logits)]
        probs = sorted(_ref_softmax(masked), reverse=True)
        if any(abs(sum(probs[:n]) - top_p) < 1e-4 for n in range(vocab + 1)):
            continue
        ref = _ref_kept(logits, temperature, top_k, top_p)
        assert _kept_by_sampler(logits, params) == ref, (logits, temperature, top_k, top_p)
        checked += 1
    assert checked > 200


def test_batched_filters_use_per_row_parameters() -> None:
    rows = [
        ([3.0, 1.0, 2.0, 2.0, 0.0], SamplingParams(top_k=2)),
        ([2.0, 1.0, 1.0, 0.0, -1.0], SamplingParams(top_p=0.6)),
        ([4.0, 3.0, 2.0, 1.0, 0.0], SamplingParams(top_k=3, top_p=0.9)),
        ([0.0, 1.0, 2.0, 3.0, 4.0], SamplingParams()),
        ([0.0, 1.0, 2.0, 3.0, 4.0], SamplingParams(temperature=0.5, top_k=1)),
    ]
    x = torch.tensor([r for r, _ in rows])
    temps = torch.tensor([[p.temperature] for _, p in rows])
    out = _apply_top_k_top_p(x / temps, [p for _, p in rows])
    for i, (logits, p) in enumerate(rows):
        got = {j for j, v in enumerate(out[i].tolist()) if v != -math.inf}
        assert got == _ref_kept(logits, p.temperature, p.top_k, p.top_p), i


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_masks_eos_and_stop_ids(device: str) -> None:
    # Token 0 (eos) and 2 (a stop id) dominate; 4 is next best.
    base = torch.tensor([10.0, 0.0, 9.0, 0.0, 5.0, 0.0])
    logits = base.expand(4, -1).to(device)
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(2, 10**9)),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(2,)),
        SamplingParams(temperature=1.0, top_k=3, min_tokens=3, stop_token_ids=(2,)),
        SamplingParams(temperature=0.0, min_tokens=3),  # its stop ids: none; eos only
    ]
    eos = frozenset({0})
    out = _call(Sampler(), logits, params, num_generated=[2, 3, 0, 1], eos=eos)
    assert out[0].token_id == 4  # under min_tokens: eos and stop id masked
    assert out[1].token_id == 0  # min_tokens reached: eos allowed again
    assert out[3].token_id == 2  # only eos masked for this request
    # Sampled row under min_tokens: top-3 of what is left is {4, 1, 3, 5} (tied); never 0 or 2.
    draws = 500
    sampled = _call(
        Sampler(),
        base.expand(draws, -1).to(device),
        [params[2]] * draws,
        num_generated=[0] * draws,
        eos=eos,
    )
    assert not {0, 2} & set(_ids(sampled))


@pytest.mark.parametrize("device", DEVICES)
def test_extreme_top_p_and_temperature_keep_the_kept_sets(device: str) -> None:
    """Values the request's checks let through but float32 cannot hold: a ``top_p`` that rounds
    to 0 keeps the top token (it used to index position -1 and stop the engine); a temperature
    that rounds to inf leaves masked tokens masked (-inf / inf was a NaN that argmax drew)."""
    base = torch.tensor([10.0, 0.0, 9.0, 0.0, 5.0, 0.0])
    draws = 200
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-50)
    out = _apply_top_k_top_p(base.expand(2, -1).to(device).clone(), [tiny_p, replace(tiny_p, top_k=3)])
    assert [[j for j, v in enumerate(row) if v != -math.inf] for row in out.tolist()] == [[0], [0]]
    assert set(_ids(_call(Sampler(), base.expand(draws, -1).to(device), [tiny_p] * draws))) == {0}
    hot = SamplingParams(temperature=1e300, top_k=3, min_tokens=3, stop_token_ids=(2,))
    sampled = _ids(_call(Sampler(), base.expand(draws, -1).to(device), [hot] * draws,
                         num_generated=[0] * draws, eos=frozenset({0})))
    # under min_tokens: eos (0) and the stop id (2) masked; top-3 of the rest is {4, 1, 3, 5} (tied)
    assert set(sampled) <= {1, 3, 4, 5} and len(set(sampled)) > 1, "a flat draw over the kept tokens"


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax(device: str) -> None:
    logits = torch.randn(4, 40, generator=_gen(4)).to(device)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.6, top_k=3, top_p=0.9, logprobs=3, min_tokens=2),
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    eos = frozenset({int(logits[1].argmax())})  # masked by min_tokens, still reported raw
    out = _call(Sampler(), logits, params, num_generated=[0, 0, 0, 0], eos=eos)
    ref = torch.log_softmax(logits.double().cpu(), dim=-1)
    for i, (tok, p) in enumerate(zip(out, params, strict=True)):
        if p.logprobs is None:
            assert tok.logprob is None and tok.top_logprobs == {}
            continue
        assert tok.logprob == pytest.approx(ref[i, tok.token_id].item(), abs=1e-5)
        assert len(tok.top_logprobs) == p.logprobs
        want = ref[i].topk(p.logprobs) if p.logprobs else None
        if want is None:
            assert tok.top_logprobs == {}
            continue
        assert list(tok.top_logprobs) == want.indices.tolist()  # most likely first
        values = list(tok.top_logprobs.values())
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(want.values.tolist(), abs=1e-5)
    assert out[1].token_id != next(iter(eos))
    assert out[1].top_logprobs[next(iter(eos))] == pytest.approx(ref[1].max().item(), abs=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_greedy_and_sampled_batch(device: str) -> None:
    logits = torch.randn(6, 30, generator=_gen(5)).to(device)
    seeded = SamplingParams(temperature=1.2, seed=77)
    params = [
        GREEDY,
        seeded,
        GREEDY,
        SamplingParams(temperature=0.8, top_k=1),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1e-6),  # below the greedy threshold
    ]
    gens: list[torch.Generator | None] = [None, _gen(77, device), None, None, None, None]
    out = _ids(_call(Sampler(), logits, params, gens))
    argmax = logits.argmax(dim=-1).tolist()
    assert [out[i] for i in (0, 2, 3, 5)] == [argmax[i] for i in (0, 2, 3, 5)]
    assert out[4] in logits[4].topk(5).indices.tolist()
    alone = _call(Sampler(), logits[1:2], [seeded], [_gen(77, device)])[0].token_id
    assert out[1] == alone


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_logits(device: str, dtype: torch.dtype) -> None:
    logits = (torch.randn(3, 64, generator=_gen(6)) * 3).to(device=device, dtype=dtype)
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.7, top_k=8, top_p=0.9, logprobs=2),
        SamplingParams(temperature=1.0, seed=1),
    ]
    out = _call(Sampler(), logits, params, [None, None, _gen(1, device)])
    assert out[0].token_id == logits.float().argmax(dim=-1)[0].item()
    assert 0 <= out[1].token_id < 64 and 0 <= out[2].token_id < 64
    ref = torch.log_softmax(logits.float().cpu(), dim=-1)
    assert out[0].logprob == pytest.approx(ref[0, out[0].token_id].item(), abs=1e-5)


def test_logits_not_modified() -> None:
    logits = torch.randn(3, 20, generator=_gen(8))
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.5, top_k=3, top_p=0.8, min_tokens=1),
        GREEDY,
        SamplingParams(temperature=2.0),
    ]
    _call(Sampler(), logits, params, num_generated=[0, 0, 0], eos=frozenset({1, 2}))
    assert torch.equal(logits, before)


def test_empty_batch_and_bad_inputs() -> None:
    sampler = Sampler()
    assert sampler(torch.empty(0, 10), [], [], [], frozenset()) == []
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, 10), [GREEDY], [None, None], [0, 0], frozenset())
    with pytest.raises(ValueError):
        sampler(torch.zeros(10), [GREEDY], [None], [0], frozenset())
    with pytest.raises(ValueError):
        sampler(torch.zeros(1, 10, dtype=torch.long), [GREEDY], [None], [0], frozenset())


# ---------------------------------------------------------------- logit bias, penalties, min_p


def _ref_processed(logits: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """vLLM's order: the bias, the repetition penalty over prompt and output tokens, then the
    frequency and presence penalties over the output's counts."""
    x = list(logits)
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    counts = Counter(output)
    for t, n in counts.items():
        x[t] -= p.frequency_penalty * n + p.presence_penalty
    return x


PROCESSING = [
    SamplingParams(temperature=0.0, logit_bias={3: 5.0, 7: -100.0}),
    SamplingParams(temperature=0.0, frequency_penalty=0.7),
    SamplingParams(temperature=0.0, presence_penalty=-1.5),
    SamplingParams(temperature=0.0, repetition_penalty=1.8),
    SamplingParams(temperature=0.0, repetition_penalty=0.5, frequency_penalty=2.0, presence_penalty=0.3,
                   logit_bias={0: 1.0}),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", PROCESSING, ids=range(len(PROCESSING)))
def test_bias_and_penalties_match_the_reference(device: str, params: SamplingParams) -> None:
    from coserve.layers.sampler import _process_logits

    torch.manual_seed(0)
    vocab = 32
    logits = torch.randn(3, vocab, device=device) * 3
    histories = [([1, 2, 3, 3], [3, 4, 4, 4, 9]), ([5], []), ([0, 31], [31, 31, 0, 6])]
    plain = SamplingParams(temperature=0.0)
    rows = [params, plain, params]  # (a row without processing is left as it was)
    got = _process_logits(logits.clone(), rows, histories.__getitem__)
    for i, (p, (prompt, output)) in enumerate(zip(rows, histories, strict=True)):
        want = _ref_processed(logits[i].tolist(), p, prompt, output)
        assert got[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-5), i
    # through the sampler: greedy rows take the processed argmax; logprobs stay the raw ones
    out = Sampler()(logits, [replace(p, logprobs=1) for p in rows], [None] * 3, [0] * 3, frozenset(),
                    histories.__getitem__)
    raw = torch.log_softmax(logits.float(), dim=-1)
    for i, tok in enumerate(out):
        assert tok.token_id == int(got[i].argmax())
        assert tok.logprob == pytest.approx(float(raw[i, tok.token_id]), abs=1e-5)


def test_a_penalty_without_token_ids_is_refused() -> None:
    with pytest.raises(ValueError, match="token ids"):
        Sampler()(torch.zeros(1, 8), [SamplingParams(frequency_penalty=1.0)], [None], [0], frozenset())


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_keeps_the_tokens_at_least_min_p_as_likely_as_the_top(min_p: float) -> None:
    from coserve.layers.sampler import _apply_min_p

    torch.manual_seed(1)
    x = torch.randn(4, 50) * 2
    probs = torch.softmax(x, dim=-1)
    got = _apply_min_p(x.clone(), [SamplingParams(min_p=min_p)] * 4)
    for i in range(4):
        want = {j for j in range(50) if probs[i, j] >= min_p * probs[i].max() * (1 - 1e-6)}
        assert {j for j in range(50) if got[i, j] != -math.inf} == want
    # sampling draws only from the kept set
    sampler = Sampler(seed=3)
    kept = {int(x[0].argmax())}
    for _ in range(20):
        (tok,) = sampler(x[:1], [SamplingParams(min_p=1.0, temperature=1.0)], [None], [0], frozenset())
        assert tok.token_id in kept


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"presence_penalty": 2.5}, "presence_penalty must be in"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in"),
    ({"min_p": -0.1}, "min_p must be in"),
    ({"logit_bias": {-1: 1.0}}, "non-negative integers"),
    ({"logit_bias": {1: 150}}, "biases must be in"),
    ({"logit_bias": {1: "x"}}, "must map token ids to numbers"),
])
def test_bad_processing_settings_are_refused(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
