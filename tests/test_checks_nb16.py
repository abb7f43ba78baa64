"""Checkers and probes of notebook 16: each passes right answers and names realistic mistakes."""

import pytest
import torch

import tfedu.layers
from checker_helpers import failure_of, not_done, verdict
from tfedu.checks import nb16_modern_architectures as nb16
from tfedu.checks.core import ExerciseNotDone, is_plain_data
from tfedu.layers import RMSNorm
from tfedu.layers import sliding_window_mask as library_window
from tfedu.positional import rope_frequencies

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- 16.1 QK-norm


def _rms(x, eps, dim=-1):
    return x / torch.sqrt(x.pow(2).mean(dim=dim, keepdim=True) + eps)


def qk_norm(q, k, v, q_gain, k_gain, rope, eps=1e-6, mistake=""):
    """A learner's answer, right or with one ``mistake``."""
    if mistake == "d_model":
        def normed(x, gain):
            b, h, p, d = x.shape
            merged = x.transpose(1, 2).reshape(b, p, h * d)
            return _rms(merged, eps).reshape(b, p, h, d).transpose(1, 2) * gain
    elif mistake == "positions":
        def normed(x, gain):
            return _rms(x, eps, dim=-2) * gain
    elif mistake == "layernorm":
        def normed(x, gain):
            return _rms(x - x.mean(-1, keepdim=True), eps) * gain
    elif mistake == "no gain":
        def normed(x, gain):
            return _rms(x, eps)
    elif mistake == "gain inside":
        def normed(x, gain):
            return _rms(x * gain, eps)
    elif mistake == "eps outside":
        def normed(x, gain):
            return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * gain
    else:
        def normed(x, gain):
            return _rms(x, eps) * gain
    if mistake == "after rope":
        return normed(rope(q), q_gain), normed(rope(k), k_gain), v
    if mistake == "no rope":
        return normed(q, q_gain), normed(k, k_gain), v
    if mistake == "swapped":
        return rope(normed(q, k_gain)), rope(normed(k, q_gain)), v
    if mistake == "values":
        return rope(normed(q, q_gain)), rope(normed(k, k_gain)), normed(v, k_gain)
    if mistake == "values rotated":
        return rope(normed(q, q_gain)), rope(normed(k, k_gain)), rope(v)
    if mistake == "detached":
        return rope(normed(q, q_gain.detach())), rope(normed(k, k_gain.detach())), v
    if mistake == "l2":
        return rope(torch.nn.functional.normalize(q, dim=-1) * q_gain), rope(torch.nn.functional.normalize(k, dim=-1) * k_gain), v
    if mistake == "sum":
        def summed(x, gain):
            return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps) * gain
        return rope(summed(q, q_gain)), rope(summed(k, k_gain)), v
    if mistake == "no k gain":
        return rope(normed(q, q_gain)), rope(_rms(k, eps)), v
    if mistake == "mul_":
        q.mul_(torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps))
        return rope(q * q_gain), rope(normed(k, k_gain)), v
    if mistake == "in place":
        q /= torch.sqrt(q.pow(2).mean(-1, keepdim=True) + eps)
        return rope(q * q_gain), rope(normed(k, k_gain)), v
    if mistake == "pair":
        return rope(normed(q, q_gain)), rope(normed(k, k_gain))
    return rope(normed(q, q_gain)), rope(normed(k, k_gain)), v


def qk_norm_rsqrt(q, k, v, q_gain, k_gain, rope, eps=1e-6):
    """Another right way: rsqrt, and einsum for the gain."""
    def normed(x, gain):
        return torch.einsum("bhpd,d->bhpd", x * torch.rsqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps), gain)
    return rope(normed(q, q_gain)), rope(normed(k, k_gain)), v


def by_library(q, k, v, q_gain, k_gain, rope, eps=1e-6):
    norm = RMSNorm(q.shape[-1], eps=eps)
    return rope(norm(q) * q_gain), rope(norm(k) * k_gain), v


QK_MISTAKES = {
    "d_model": "every head at once",
    "positions": "over the positions",
    "after rope": "rotated first",
    "layernorm": "subtracted the mean",
    "no gain": "gains are missing",
    "gain inside": "before normalising",
    "eps outside": "eps is outside the square root",
    "no rope": "not rotated",
    "swapped": "gains are swapped",
    "values": "normalised the values",
    "values rotated": "rotated the values",
    "l2": "length 1",
    "sum": "length 1",
    "no k gain": "keys lack their gain",
}


def test_qk_norm_passes_right_answers():
    nb16.check_qk_norm(qk_norm)
    nb16.check_qk_norm(qk_norm_rsqrt)
    nb16.check_qk_norm(nb16.reference_qk_norm)


@pytest.mark.parametrize("mistake", QK_MISTAKES)
def test_qk_norm_check_names_each_mistake(mistake):
    message = failure_of(nb16.check_qk_norm, lambda *args: qk_norm(*args, mistake=mistake))
    assert QK_MISTAKES[mistake] in message, message


def test_qk_norm_check_refuses_shortcuts_and_names_other_slips():
    assert "tfedu" in failure_of(nb16.check_qk_norm, by_library)
    for slip in ("in place", "mul_"):
        message = failure_of(nb16.check_qk_norm, lambda *args, m=slip: qk_norm(*args, mistake=m))
        assert "nothing may be written into q or k" in message and "leaf Variable" not in message, message
    assert "gradient" in failure_of(nb16.check_qk_norm, lambda *args: qk_norm(*args, mistake="detached"))
    assert "tuple (q, k, v)" in failure_of(nb16.check_qk_norm, lambda *args: qk_norm(*args, mistake="pair"))
    with pytest.raises(ExerciseNotDone):
        nb16.check_qk_norm(not_done)


def test_qk_norm_probe_passes_right_answers_and_names_mistakes():
    probe = nb16.PROBES["check_qk_norm"]
    for seed in range(4):
        assert is_plain_data(probe.make_inputs(__import__("numpy").random.default_rng(seed)))
        assert verdict(probe, {"qk_norm": qk_norm}, seed) is None
        assert verdict(probe, {"qk_norm": qk_norm_rsqrt}, seed) is None
    for mistake, words in QK_MISTAKES.items():
        for seed in (0, 1):
            message = verdict(probe, {"qk_norm": lambda *args, m=mistake: qk_norm(*args, mistake=m)}, seed)
            assert message is not None and words in message, (mistake, seed, message)
    for slip in ("in place", "mul_"):
        in_place = verdict(probe, {"qk_norm": lambda *args, m=slip: qk_norm(*args, mistake=m)}, 0)
        assert in_place is not None and "nothing may be written into q or k" in in_place


# ----------------------------------------------------------------------------- 16.2 the sliding-window mask


def window_mask(n_query, n_key, window, mistake=""):
    """A learner's answer, right or with one ``mistake``."""
    q = torch.arange(n_query)[:, None] + (0 if mistake == "start" else n_key - n_query)
    j = torch.arange(n_key)[None, :]
    back = q - j
    if mistake == "wide":
        return (back >= 0) & (back <= window)
    if mistake == "narrow":
        return (back >= 0) & (back < window - 1)
    if mistake == "not causal":
        return back.abs() < window
    if mistake == "wrong end":
        return (back >= 0) & (j < window)
    if mistake == "causal only":
        return back >= 0
    if mistake == "inverted":
        return ~((back >= 0) & (back < window))
    if mistake == "int":
        return ((back >= 0) & (back < window)).int()
    return (back >= 0) & (back < window)


def window_by_triu(n_query, n_key, window):
    """Another right way: tril and triu of a matrix of ones."""
    ones = torch.ones(n_query, n_key, dtype=torch.bool)
    return ones.tril(n_key - n_query) & ones.triu(n_key - n_query - window + 1)


SW_MISTAKES = {
    "wide": "one key too many",
    "narrow": "one key too few",
    "not causal": "keys after the query are visible",
    "start": "aligned to the start",
    "wrong end": "oldest keys",
    "causal only": "window is ignored",
    "inverted": "inverted",
    "int": "torch.bool",
}


def test_window_mask_passes_right_answers():
    nb16.check_sliding_window_mask(window_mask)
    nb16.check_sliding_window_mask(window_by_triu)
    nb16.check_sliding_window_mask(nb16.reference_sliding_window_mask)
    for nq, nk, w in nb16.sw_cases():
        assert torch.equal(nb16.reference_sliding_window_mask(nq, nk, w), tfedu.layers.sliding_window_mask(nq, nk, w))


@pytest.mark.parametrize("mistake", SW_MISTAKES)
def test_window_mask_check_names_each_mistake(mistake):
    message = failure_of(nb16.check_sliding_window_mask, lambda *args: window_mask(*args, mistake=mistake))
    assert SW_MISTAKES[mistake] in message, message


def test_window_mask_check_refuses_the_library():
    assert "tfedu" in failure_of(nb16.check_sliding_window_mask, lambda nq, nk, w: library_window(nq, nk, w))
    with pytest.raises(ExerciseNotDone):
        nb16.check_sliding_window_mask(not_done)


def test_window_mask_probe_passes_right_answers_and_names_mistakes():
    probe = nb16.PROBES["check_sliding_window_mask"]
    for seed in range(4):
        assert verdict(probe, {"sliding_window_mask": window_mask}, seed) is None
        assert verdict(probe, {"sliding_window_mask": window_by_triu}, seed) is None
    for mistake, words in SW_MISTAKES.items():
        for seed in (0, 1):
            message = verdict(probe, {"sliding_window_mask": lambda *args, m=mistake: window_mask(*args, mistake=m)}, seed)
            assert message is not None and words in message, (mistake, seed, message)


# ----------------------------------------------------------------------------- 16.3 the ring-buffer cache


def ring_append(ring_k, ring_v, length, k, v, mistake=""):
    """A learner's answer, written differently from the reference (a loop over positions), or with one ``mistake``."""
    slots, new = ring_k.shape[2], k.shape[2]
    if mistake in nb16.RING_MISTAKES:
        return nb16.reference_ring_append(ring_k, ring_v, length, k, v, mistake=mistake)
    kept = [p % slots for p in range(max(0, length - slots), length)]
    keys = torch.cat([ring_k[:, :, kept], k], dim=2)
    values = torch.cat([ring_v[:, :, kept], v], dim=2)
    if mistake == "returns keys twice":
        return keys, keys
    for i in range(new):
        p = length + i
        if mistake == "write all" or i >= new - slots:
            ring_k[:, :, p % slots] = k[:, :, i]
            ring_v[:, :, p % slots] = v[:, :, i]
    if mistake == "keys only":
        return keys
    return keys, values


def ring_append_rolled(ring_k, ring_v, length, k, v):
    """Another right way: roll the ring so the oldest kept slot comes first."""
    slots = ring_k.shape[2]
    held = min(length, slots)
    rolled_k = torch.roll(ring_k, -(length % slots), dims=2)[:, :, slots - held:]
    rolled_v = torch.roll(ring_v, -(length % slots), dims=2)[:, :, slots - held:]
    keys, values = torch.cat([rolled_k, k], 2), torch.cat([rolled_v, v], 2)
    for i in range(max(0, k.shape[2] - slots), k.shape[2]):
        ring_k[:, :, (length + i) % slots] = k[:, :, i]
        ring_v[:, :, (length + i) % slots] = v[:, :, i]
    return keys, values


RING_WORDS = {"slot plus one": "wrong slot", "ring order": "slot order", "write first": "before reading",
              "ring only": "one key short", "no write": "nothing was written"}


def test_ring_passes_right_answers():
    nb16.check_ring_append(ring_append)
    nb16.check_ring_append(ring_append_rolled)
    nb16.check_ring_append(nb16.reference_ring_append)
    nb16.check_ring_append(lambda *args: ring_append(*args, mistake="write all"))  # writing every new one: same ring


def test_the_reference_ring_is_the_librarys():
    from tfedu.kv_cache import RingKVCache

    for slots, calls in nb16.ring_cases():
        batch, heads, _, d_head = calls[0][0].shape
        ring = RingKVCache(batch, heads, slots + 1, d_head, capacity=1000)
        ours_k, ours_v, length = torch.zeros(batch, heads, slots, d_head), torch.zeros(batch, heads, slots, d_head), 0
        for k, v in calls:
            theirs = ring.append(k, v)
            ours = nb16.reference_ring_append(ours_k, ours_v, length, k, v)
            length += k.shape[2]
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("mistake", RING_WORDS)
def test_ring_check_names_each_mistake(mistake):
    message = failure_of(nb16.check_ring_append, lambda *args: ring_append(*args, mistake=mistake))
    assert RING_WORDS[mistake] in message, message


def test_ring_check_names_other_slips():
    assert "values differ" in failure_of(nb16.check_ring_append, lambda *args: ring_append(*args, mistake="returns keys twice"))
    assert "tuple (keys, values)" in failure_of(nb16.check_ring_append, lambda *args: ring_append(*args, mistake="keys only"))
    with pytest.raises(ExerciseNotDone):
        nb16.check_ring_append(not_done)


def ring_append_keys_in_values(ring_k, ring_v, length, k, v):
    """A learner's slip: the keys written into the value ring (their exact code)."""
    slots, new = ring_k.shape[2], k.shape[2]
    held = min(length, slots)
    kept = torch.arange(length - held, length) % slots
    keys = torch.cat([ring_k[:, :, kept], k], dim=2)
    values = torch.cat([ring_v[:, :, kept], v], dim=2)
    n_write = min(new, slots)
    idx = torch.arange(length + new - n_write, length + new) % slots
    ring_k[:, :, idx] = k[:, :, new - n_write:]
    ring_v[:, :, idx] = k[:, :, new - n_write:]
    return keys, values


def test_ring_names_the_keys_written_into_the_value_ring():
    message = failure_of(nb16.check_ring_append, ring_append_keys_in_values)
    assert "keys into the value ring" in message, message
    probe = nb16.PROBES["check_ring_append"]
    for seed in (0, 1):
        message = verdict(probe, {"ring_append": ring_append_keys_in_values}, seed)
        assert message is not None and "keys into the value ring" in message, (seed, message)


def ring_append_repeated_slots(ring_k, ring_v, length, k, v):
    """A learner's answer that writes every new position in one indexed assignment: repeated slots when new > slots."""
    slots, new = ring_k.shape[2], k.shape[2]
    held = min(length, slots)
    kept = torch.arange(length - held, length) % slots
    keys = torch.cat([ring_k[:, :, kept], k], dim=2)
    values = torch.cat([ring_v[:, :, kept], v], dim=2)
    idx = torch.arange(length, length + new) % slots
    ring_k[:, :, idx] = k
    ring_v[:, :, idx] = v
    return keys, values


def ring_append_index_copy(ring_k, ring_v, length, k, v):
    """The same undefined write with index_copy_."""
    slots, new = ring_k.shape[2], k.shape[2]
    keys, values = ring_append(ring_k.clone(), ring_v.clone(), length, k, v)
    idx = torch.arange(length, length + new) % slots
    ring_k.index_copy_(2, idx, k)
    ring_v.index_copy_(2, idx, v)
    return keys, values


def test_ring_names_writes_that_repeat_a_slot():
    for fn in (ring_append_repeated_slots, ring_append_index_copy):
        message = failure_of(nb16.check_ring_append, fn)
        assert "same slot" in message and "does not define" in message, message
        probe = nb16.PROBES["check_ring_append"]
        for seed in (0, 1):
            message = verdict(probe, {"ring_append": fn}, seed)
            assert message is not None and "same slot" in message, (seed, message)


def test_ring_messages_name_the_ring_and_never_two_equal_lists():
    def wrong_values(ring_k, ring_v, length, k, v):
        keys, values = ring_append(ring_k, ring_v, length, k, v)
        ring_v.mul_(2)
        return keys, values

    def wrong_keys(ring_k, ring_v, length, k, v):
        keys, values = ring_append(ring_k, ring_v, length, k, v)
        ring_k[..., 1:] *= 2
        return keys, values

    message = failure_of(nb16.check_ring_append, wrong_values)
    assert "value ring" in message and "expected" not in message, message
    message = failure_of(nb16.check_ring_append, wrong_keys)
    assert "key ring" in message and "expected" not in message, message


def test_ring_probe_passes_right_answers_and_names_mistakes():
    probe = nb16.PROBES["check_ring_append"]
    for seed in range(4):
        assert verdict(probe, {"ring_append": ring_append}, seed) is None
        assert verdict(probe, {"ring_append": ring_append_rolled}, seed) is None
    for mistake, words in RING_WORDS.items():
        for seed in (0, 1):
            message = verdict(probe, {"ring_append": lambda *args, m=mistake: ring_append(*args, mistake=m)}, seed)
            assert message is not None and words in message, (mistake, seed, message)


# ----------------------------------------------------------------------------- 16.4 Llama 3.1's RoPE scaling


def llama3_frequencies(d_head, base, scaling, mistake=""):
    """A learner's answer in float32 with a mask per region (another right way), or with one ``mistake``."""
    if mistake:
        return nb16.reference_llama3_frequencies(d_head, base, scaling, mistake=mistake)
    s, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    L = scaling["original_max_position_embeddings"]
    theta = 1.0 / base ** (torch.arange(d_head // 2, dtype=torch.float32) * 2 / d_head)
    wavelength = 2 * torch.pi / theta
    out = theta / s
    fast = wavelength < L / high
    out[fast] = theta[fast]
    middle = ~fast & (wavelength <= L / low)
    smooth = (L / wavelength[middle] - low) / (high - low)
    out[middle] = (1 - smooth) * theta[middle] / s + smooth * theta[middle]
    return out


def test_llama3_passes_right_answers_and_equals_the_library():
    nb16.check_llama3_frequencies(llama3_frequencies)
    nb16.check_llama3_frequencies(nb16.reference_llama3_frequencies)
    for _, d_head, base, scaling in nb16.l3_cases():
        assert torch.allclose(nb16.reference_llama3_frequencies(d_head, base, scaling),
                              rope_frequencies(d_head, base, scaling)[0], rtol=1e-12, atol=0)


@pytest.mark.parametrize("mistake", nb16.L3_MISTAKES)
def test_llama3_check_names_each_mistake(mistake):
    message = failure_of(nb16.check_llama3_frequencies, lambda *args: llama3_frequencies(*args, mistake=mistake))
    assert nb16.L3_MISTAKES[mistake][:40] in message, message


def test_llama3_check_refuses_the_library_and_wrong_types():
    assert "tfedu" in failure_of(nb16.check_llama3_frequencies, lambda d, b, s: rope_frequencies(d, b, s)[0])
    assert "float torch tensor" in failure_of(nb16.check_llama3_frequencies, lambda d, b, s: [1.0] * (d // 2))
    with pytest.raises(ExerciseNotDone):
        nb16.check_llama3_frequencies(not_done)


def test_llama3_probe_passes_right_answers_and_names_mistakes():
    import numpy as np

    probe = nb16.PROBES["check_llama3_frequencies"]
    for seed in range(4):
        for d_head, base, scaling in probe.make_inputs(np.random.default_rng(seed))["cases"]:
            assert torch.allclose(nb16.reference_llama3_frequencies(d_head, base, scaling),
                                  rope_frequencies(d_head, base, scaling)[0], rtol=1e-12, atol=0)
        assert verdict(probe, {"llama3_frequencies": llama3_frequencies}, seed) is None
    for mistake, hint in nb16.L3_MISTAKES.items():
        for seed in (0, 1):
            message = verdict(probe, {"llama3_frequencies": lambda *args, m=mistake: llama3_frequencies(*args, mistake=m)}, seed)
            assert message is not None and hint[:40] in message, (mistake, seed, message)
