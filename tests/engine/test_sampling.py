"""SamplingParams follows vLLM's rules; the batched Sampler draws the right distribution, keeps
seeded rows independent of their batch, and talks to the host once per call. No model is loaded."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from kvlab.sampling import (
    RequestOutputKind,
    Sampler,
    SamplerOutput,
    SamplingParams,
    sample,
)

CPU = torch.device("cpu")


def gen(seed: int) -> torch.Generator:
    g = torch.Generator(device=CPU)
    g.manual_seed(seed)
    return g


def rand_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=gen(seed), device=CPU) * scale


# ---------------------------------------------------------------- SamplingParams


def test_new_fields_have_vllm_defaults():
    sp = SamplingParams()
    assert sp.stop == [] and sp.include_stop_str_in_output is False
    assert sp.skip_special_tokens is True and sp.detokenize is True
    assert sp.logprobs is None and sp.output_kind is RequestOutputKind.CUMULATIVE
    assert [k.name for k in RequestOutputKind] == ["CUMULATIVE", "DELTA", "FINAL_ONLY"]
    assert not sp.greedy and SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("stop, expected", [
    (None, []), ("END", ["END"]), (["a", "bc"], ["a", "bc"]), (("x",), ["x"]),
])
def test_stop_is_normalised_to_a_list(stop, expected):
    assert SamplingParams(stop=stop).stop == expected


@pytest.mark.parametrize("kwargs, error, words", [
    ({"stop": ""}, ValueError, "stop"),
    ({"stop": ["ok", ""]}, ValueError, "stop"),
    ({"stop": ["ok", 3]}, TypeError, "stop"),
    ({"stop": 5}, TypeError, "stop"),
    ({"stop": ["x"], "detokenize": False}, ValueError, "detokenize"),
    ({"include_stop_str_in_output": 1}, TypeError, "include_stop_str_in_output"),
    ({"skip_special_tokens": "no"}, TypeError, "skip_special_tokens"),
    ({"detokenize": None}, TypeError, "detokenize"),
    ({"logprobs": -1}, ValueError, "logprobs"),
    ({"logprobs": True}, TypeError, "logprobs"),
    ({"logprobs": 1.0}, TypeError, "logprobs"),
    ({"output_kind": "DELTA"}, TypeError, "output_kind"),
    ({"temperature": float("inf")}, ValueError, "temperature"),
    ({"temperature": -float("inf")}, ValueError, "temperature"),
    ({"temperature": -0.1}, ValueError, "temperature"),
    ({"seed": 2**63}, ValueError, r"seed.*\[-2\*\*63, 2\*\*63 - 1\]"),
    ({"seed": -(2**63) - 1}, ValueError, r"seed.*\[-2\*\*63, 2\*\*63 - 1\]"),
    ({"seed": True}, TypeError, "seed"),
    ({"seed": 1.0}, TypeError, "seed"),
])
def test_bad_new_values_are_refused(kwargs, error, words):
    with pytest.raises(error, match=words):
        SamplingParams(**kwargs)


def test_logprobs_zero_and_output_kinds_are_accepted():
    assert SamplingParams(logprobs=0).logprobs == 0
    for kind in RequestOutputKind:
        assert SamplingParams(output_kind=kind).output_kind is kind


@pytest.mark.parametrize("t", [1e-40, 1e-6, 0.005])
def test_tiny_temperature_is_raised_to_0_01_with_a_warning(t):
    with pytest.warns(UserWarning, match=r"0\.01"):
        sp = SamplingParams(temperature=t)
    assert sp.temperature == 0.01 and not sp.greedy
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # idempotent: verifying again neither warns nor changes
        sp.verify()
    assert sp.temperature == 0.01


def test_zero_temperature_stays_greedy_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sp = SamplingParams(temperature=0)
        sp.verify()
    assert sp.temperature == 0 and sp.greedy


@pytest.mark.parametrize("seed", [-(2**63), -2, 0, 2**32, 2**63 - 1])
def test_signed_64_bit_seeds_are_accepted(seed):
    assert SamplingParams(seed=seed).seed == seed


def test_seed_minus_one_means_no_seed():
    sp = SamplingParams(seed=-1)
    assert sp.seed is None
    sp.verify()
    assert sp.seed is None


def test_seed_plus_sample_index_does_not_overflow():
    # The engine seeds sample i of n with seed + i; torch accepts up to 2**64 - 1.
    sp = SamplingParams(seed=2**63 - 1, n=4, temperature=1.0)
    gens = [gen(sp.seed + i) for i in range(sp.n)]
    logits = rand_logits(4, 50)
    out = Sampler(CPU, 0)(logits, [sp] * 4, gens)
    assert len(out.token_ids) == 4 and all(0 <= t < 50 for t in out.token_ids)
    again = Sampler(CPU, 1)(logits, [sp] * 4, [gen(sp.seed + i) for i in range(sp.n)])
    assert again.token_ids == out.token_ids  # the seeds alone decide


@pytest.mark.parametrize("field, value, error", [
    ("temperature", -1, ValueError),
    ("temperature", float("nan"), ValueError),
    ("top_p", 2.0, ValueError),
    ("top_k", -5, ValueError),
    ("seed", 2**64, ValueError),
    ("max_tokens", 0, ValueError),
    ("n", "2", TypeError),
    ("stop", [""], ValueError),
    ("logprobs", -3, ValueError),
    ("output_kind", 2, TypeError),
    ("stop_token_ids", [1, "2"], TypeError),
])
def test_verify_catches_fields_changed_after_construction(field, value, error):
    sp = SamplingParams()
    setattr(sp, field, value)
    with pytest.raises(error, match=field):
        sp.verify()


def test_verify_normalises_fields_changed_after_construction():
    sp = SamplingParams()
    sp.stop, sp.seed, sp.stop_token_ids = "END", -1, (2, 3)
    sp.temperature = 1e-3
    with pytest.warns(UserWarning):
        sp.verify()
    assert (sp.stop, sp.seed, sp.stop_token_ids, sp.temperature) == (["END"], None, [2, 3], 0.01)


# ---------------------------------------------------------------- Sampler: semantics


def test_greedy_rows_take_the_argmax_of_the_raw_logits():
    logits = rand_logits(16, 100)
    greedy = SamplingParams(temperature=0, top_k=3, top_p=0.1)  # filters do not matter
    out = Sampler(CPU, 0)(logits, [greedy] * 16, [None] * 16)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16


def test_greedy_rows_are_argmax_inside_a_mixed_batch():
    logits = rand_logits(8, 100, seed=1)
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=1.5)
              for i in range(8)]
    gens = [gen(i) if i % 4 == 0 else None for i in range(8)]
    out = Sampler(CPU, 0)(logits, params, gens)
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in range(1, 8, 2)] == [argmax[i] for i in range(1, 8, 2)]


def test_top_k_keeps_ties_at_the_kth_value():
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]], device=CPU)
    probs = Sampler(CPU, 0).probs(logits, [SamplingParams(top_k=2)])[0]
    assert probs[0] > 0 and probs[1] > 0 and probs[2] > 0 and probs[3] == 0
    assert probs[1] == probs[2]


@pytest.mark.parametrize("k", [0, -1, 4, 100])
def test_top_k_off_values_keep_every_token(k):
    logits = torch.tensor([[3.0, 1.0, 0.5, 0.0]], device=CPU)
    probs = Sampler(CPU, 0).probs(logits, [SamplingParams(top_k=k)])[0]
    assert torch.allclose(probs, logits[0].softmax(-1))


@pytest.mark.parametrize("p, kept", [(0.4, 1), (0.75, 2), (0.81, 3), (0.99, 4), (1.0, 4)])
def test_top_p_keeps_the_smallest_prefix_that_reaches_p(p, kept):
    base = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float32, device=CPU)
    logits = base.log()[[2, 0, 3, 1]].unsqueeze(0)  # shuffled: order must not matter
    probs = Sampler(CPU, 0).probs(logits, [SamplingParams(top_p=p)])[0]
    survivors = probs[[1, 3, 0, 2]]  # back in descending-probability order
    assert (survivors > 0).tolist() == [True] * kept + [False] * (4 - kept)
    assert torch.allclose(survivors[:kept], base[:kept] / base[:kept].sum())


def test_top_p_always_keeps_the_top_token():
    logits = torch.tensor([[5.0, 0.0, 0.0]], device=CPU)
    probs = Sampler(CPU, 0).probs(logits, [SamplingParams(top_p=1e-9)])[0]
    assert probs.tolist() == [1.0, 0.0, 0.0]


def _reference_probs(logits: list[float], sp: SamplingParams) -> list[float]:
    """Softmax(logits / T), then top-k, then top-p, in float64 Python: independent of the
    Sampler's tensor code."""
    z = [x / sp.temperature for x in logits]
    if 0 < sp.top_k < len(z):
        kth = sorted(z, reverse=True)[sp.top_k - 1]
        z = [x if x >= kth else -math.inf for x in z]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    p = [x / sum(e) for x in e]
    if sp.top_p < 1:
        mass, keep = 0.0, set()
        for i in sorted(range(len(p)), key=lambda i: -p[i]):
            if mass >= sp.top_p:
                break
            keep.add(i)
            mass += p[i]
        p = [x if i in keep else 0.0 for i, x in enumerate(p)]
        p = [x / sum(p) for x in p]
    return p


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=2),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=0.8, top_k=3, top_p=0.8),
], ids=["T1", "T0.7", "topk2", "topp0.7", "topk3-topp0.8"])
def test_empirical_distribution_matches_softmax_after_filters(sp):
    logits = [1.0, 0.5, 0.0, -1.0]
    draws = 20_000
    batch = torch.tensor([logits], device=CPU).expand(draws, 4).contiguous()
    tokens = Sampler(CPU, 1234)(batch, [sp] * draws, [None] * draws).token_ids  # one call
    expected = _reference_probs(logits, sp)
    for tok, p in enumerate(expected):
        freq = tokens.count(tok) / draws
        if p == 0:
            assert freq == 0, f"token {tok} was filtered out but drawn"
        else:
            stderr = math.sqrt(p * (1 - p) / draws)
            assert abs(freq - p) < 5 * stderr, f"token {tok}: {freq:.4f} vs {p:.4f}"


def test_seeded_rows_draw_from_their_own_generator():
    # Many rows with the same seed and the same logits draw the same token; seeded draws
    # follow the generator, so they are still distributed as softmax over rows of seeds.
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0]], device=CPU).expand(4000, 4).contiguous()
    sp = SamplingParams(temperature=1.0)
    same = Sampler(CPU, 0)(logits[:8], [sp] * 8, [gen(99) for _ in range(8)]).token_ids
    assert len(set(same)) == 1
    tokens = Sampler(CPU, 0)(logits, [sp] * 4000, [gen(s) for s in range(4000)]).token_ids
    expected = _reference_probs([1.0, 0.5, 0.0, -1.0], sp)
    for tok, p in enumerate(expected):
        assert abs(tokens.count(tok) / 4000 - p) < 5 * math.sqrt(p * (1 - p) / 4000)


def test_a_seeded_row_draws_the_same_tokens_whatever_its_batch():
    vocab, steps = 300, 6
    mine = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=123)
    step_logits = [rand_logits(1, vocab, seed=100 + s) for s in range(steps)]

    alone_gen, alone = gen(123), []
    sampler = Sampler(CPU, 0)
    for logits in step_logits:
        alone += sampler(logits, [mine], [alone_gen]).token_ids

    neighbours = [SamplingParams(temperature=0), SamplingParams(temperature=1.2),
                  SamplingParams(temperature=0.7, top_p=0.5, seed=5), SamplingParams(top_k=3),
                  SamplingParams(temperature=0)]
    in_batch_gen, other_gen, in_batch = gen(123), gen(5), []
    sampler = Sampler(CPU, 987)  # a different engine seed changes only the unseeded rows
    for s, logits in enumerate(step_logits):
        where = s % 6  # move the row around the batch too
        others = rand_logits(5, vocab, seed=200 + s)
        batch = torch.cat([others[:where], logits, others[where:]])
        params = neighbours[:where] + [mine] + neighbours[where:]
        gens = [None, None, other_gen, None, None]
        gens = gens[:where] + [in_batch_gen] + gens[where:]
        in_batch.append(sampler(batch, params, gens).token_ids[where])
    assert in_batch == alone


def test_unseeded_rows_are_reproducible_per_sampler_seed():
    logits = rand_logits(64, 50)
    params, gens = [SamplingParams(temperature=1.0)] * 64, [None] * 64
    a = Sampler(CPU, 7)(logits, params, gens).token_ids
    b = Sampler(CPU, 7)(logits, params, gens).token_ids
    c = Sampler(CPU, 8)(logits, params, gens).token_ids
    assert a == b and a != c


def test_the_sampler_advances_its_generator_between_calls():
    logits = rand_logits(64, 50)
    sampler = Sampler(CPU, 7)
    params, gens = [SamplingParams(temperature=1.0)] * 64, [None] * 64
    assert sampler(logits, params, gens).token_ids != sampler(logits, params, gens).token_ids


@pytest.mark.parametrize("mutate", [False, True])
def test_temperature_1e_40_gives_finite_probabilities_and_a_valid_token(mutate):
    logits = torch.tensor([[60.0, 59.0, -80.0, 0.0], [1e4, -1e4, 0.0, 3.0]], device=CPU)
    if mutate:  # set after construction, no verify(): the sampler must still not make NaN
        sp = SamplingParams()
        sp.temperature = 1e-40
    else:
        with pytest.warns(UserWarning):
            sp = SamplingParams(temperature=1e-40)
    sampler = Sampler(CPU, 0)
    probs = sampler.probs(logits, [sp, sp])
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))
    out = sampler(logits, [sp, sp], [None, gen(1)])
    assert all(0 <= t < 4 for t in out.token_ids)
    assert out.token_ids[1] == 0  # 1e4 / 0.01 dominates completely


def test_the_input_logits_are_not_modified():
    logits = rand_logits(4, 30)
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_k=5, top_p=0.5, logprobs=2)] * 4
    Sampler(CPU, 0)(logits, params, [None, gen(1), None, gen(2)])
    assert torch.equal(logits, before)


def test_bfloat16_logits_are_sampled_in_float32():
    logits = rand_logits(6, 40).to(torch.bfloat16)
    params = [SamplingParams(temperature=0), SamplingParams(top_p=0.9, logprobs=2)] * 3
    out = Sampler(CPU, 0)(logits, params, [None] * 6)
    assert out.token_ids[0] == int(logits[0].float().argmax())
    assert all(isinstance(v, float) for v in out.logprobs[1].values())


def test_bad_batches_are_refused():
    sampler = Sampler(CPU, 0)
    with pytest.raises(ValueError, match="one SamplingParams"):
        sampler(rand_logits(2, 5), [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match="batch, vocab"):
        sampler(torch.zeros(5, device=CPU), [SamplingParams()], [None])
    assert sampler(torch.zeros(0, 5, device=CPU), [], []) == SamplerOutput([], [])


# ---------------------------------------------------------------- Sampler: logprobs


def test_logprobs_are_raw_log_softmax_with_the_sampled_token_first():
    logits = rand_logits(5, 20, seed=3)
    raw = logits.log_softmax(-1)
    params = [
        SamplingParams(temperature=0.5, logprobs=3),   # scaled for sampling, raw for logprobs
        SamplingParams(temperature=0, logprobs=0),     # the sampled token alone
        SamplingParams(temperature=1.0),               # none asked
        SamplingParams(temperature=2.0, top_k=2, logprobs=1),
        SamplingParams(temperature=0, logprobs=50),    # more than the vocabulary: all of it
    ]
    out = Sampler(CPU, 0)(logits, params, [gen(1), None, None, None, None])
    assert out.logprobs[2] is None
    for row, sp in enumerate(params):
        if sp.logprobs is None:
            continue
        entry, tok = out.logprobs[row], out.token_ids[row]
        ids = list(entry)
        assert ids[0] == tok  # the sampled token comes first, as in vLLM
        top = raw[row].topk(min(sp.logprobs, 20)).indices.tolist()
        assert set(ids) == set(top) | {tok}
        assert [i for i in ids if i != tok] == [i for i in top if i != tok]  # ranked order
        for i, v in entry.items():
            assert v == pytest.approx(raw[row, i].item(), abs=1e-6)
    assert len(out.logprobs[1]) == 1 and len(out.logprobs[4]) == 20


# ---------------------------------------------------------------- Sampler: the host boundary


def _mixed_batch(rows: int, vocab: int):
    logits = rand_logits(rows, vocab, seed=11)
    kinds = [
        (SamplingParams(temperature=0), None),
        (SamplingParams(temperature=0.8), None),
        (SamplingParams(temperature=0.8, top_k=20, seed=1), "seed"),
        (SamplingParams(temperature=1.1, top_p=0.9, logprobs=4), None),
        (SamplingParams(temperature=0.6, top_k=5, top_p=0.8, seed=2, logprobs=0), "seed"),
        (SamplingParams(temperature=0, logprobs=2), None),
    ]
    params, gens = [], []
    for i in range(rows):
        sp, seeded = kinds[i % len(kinds)]
        params.append(sp)
        gens.append(gen(1000 + i) if seeded else None)
    return logits, params, gens


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_a_large_batch_costs_exactly_one_host_transfer(monkeypatch, with_logprobs):
    logits, params, gens = _mixed_batch(96, 500)
    if not with_logprobs:
        params = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                 seed=p.seed) for p in params]
    sampler = Sampler(CPU, 0)
    calls: list[str] = []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)
        return wrapper

    for name in ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__",
                 "__index__", "__array__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    out = sampler(logits, params, gens)
    monkeypatch.undo()
    assert calls == ["tolist"]
    assert len(out.token_ids) == 96
    assert (out.logprobs[3] is not None) == with_logprobs


def test_the_sampler_creates_no_tensor_on_the_default_device():
    # Under set_default_device("meta"), a tensor made without device= lands on meta and any
    # attempt to read it fails loudly. Logits are made on CPU first.
    logits, params, gens = _mixed_batch(12, 64)
    expected = Sampler(CPU, 5)(logits, params, [None if g is None else gen(1000 + i)
                                                for i, g in enumerate(gens)])
    torch.set_default_device("meta")
    try:
        sampler = Sampler(CPU, 5)
        out = sampler(logits, params, gens)
        probs = sampler.probs(logits, params)
        legacy = sample(logits, params, [None if g is None else gen(1000 + i)
                                         for i, g in enumerate(gens)])
    finally:
        torch.set_default_device(None)
    assert out == expected
    assert probs.device == CPU and torch.isfinite(probs).all()
    assert all(0 <= t < 64 for t in legacy)
    assert torch.empty(1).device == CPU  # the default really was restored


# ---------------------------------------------------------------- backward compatibility


def test_module_level_sample_matches_a_sampler_for_greedy_and_seeded_rows():
    logits = rand_logits(6, 80, seed=4)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=3)] * 3
    tokens = sample(logits, params, [None if i % 2 == 0 else gen(i) for i in range(6)])
    out = Sampler(CPU, 0)(logits, params, [None if i % 2 == 0 else gen(i) for i in range(6)])
    assert tokens == out.token_ids and all(isinstance(t, int) for t in tokens)
