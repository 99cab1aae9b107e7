"""decoding.Sampler, the one sampler of every runtime, against an independent reference: the softmax torch computes
and the top-p nucleus as the OpenAI API and transformers' TopPLogitsWarper define it (the most probable tokens until
their mass reaches top_p), written here as a plain loop."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3compile.decoding import Sampler


def reference(logits: list[float], temperature: float, top_p: float, slack: float = 0.0) -> list[float]:
    """The probability of each token: torch's softmax of logits / T, zero outside the nucleus, renormalized. `slack`
    widens the nucleus by a token whose mass before it is within slack of top_p (in or out by float rounding)."""
    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64) / temperature, dim=-1).tolist()
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if mass >= top_p + slack:
            break
        kept.add(i)
        mass += probs[i]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


def test_draws_follow_the_reference_distribution():
    """40000 draws (one batch of 40000 equal rows) per case: each token's frequency within 5 standard deviations of
    the reference probability (binomial; a seeded run, so the bound is checked once, not re-rolled), and no token
    outside the nucleus drawn."""
    logits = [1.5, 0.2, -0.7, 2.1, 0.9, -3.0]
    n = 40000
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.8), (2.0, 0.5), (0.3, 0.95)):
        want = reference(logits, temperature, top_p)
        drawn = Sampler(temperature, top_p, seed=11)(np.tile(np.float32(logits), (n, 1)))
        freq = np.bincount(drawn, minlength=len(logits)) / n
        for p, f in zip(want, freq):
            if p == 0:
                assert f == 0, (temperature, top_p, want, freq)
            else:
                assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / n), (temperature, top_p, want, freq)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.floats(-30, 30, width=32), min_size=2, max_size=9), min_size=1, max_size=4)
       .filter(lambda r: len({len(x) for x in r}) == 1),
       temperature=st.sampled_from([0.0, 1e-45, 0.05, 0.8, 1.0, 5.0, 1e30]),
       top_p=st.sampled_from([1e-9, 0.1, 0.5, 0.9, 1.0]), seed=st.integers(0, 2**64 - 1))
def test_every_draw_has_reference_mass_and_a_seed_repeats(rows, temperature, top_p, seed):
    """Over random logits (ties included), temperatures from 0 to 1e30 and nuclei: the argmax's first maximum at
    temperature 0 (torch.argmax's), else a token the reference gives mass (for a tiny temperature: a maximum); the
    same seed draws the same tokens."""
    logits = np.array(rows, dtype=np.float32)
    got = Sampler(temperature, top_p, seed)(logits)
    assert got.dtype == np.int64 and got.shape == (len(rows),)
    if temperature == 0:
        assert got.tolist() == torch.from_numpy(logits).argmax(-1).tolist()
        return
    for row, token in zip(rows, got):
        if temperature < 1e-30:
            assert row[token] == max(row)
        else:
            # slack 1e-9: the two sums of float64 masses (torch's softmax, numpy's) differ by ~1e-16
            assert reference(row, temperature, top_p, slack=1e-9)[token] > 0, (row, token)
    assert Sampler(temperature, top_p, seed)(logits).tolist() == got.tolist()
