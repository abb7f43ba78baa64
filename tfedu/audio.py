"""Audio as tokens: log-mel spectrograms by hand, a synthetic sound data set, and the Conformer.

A Transformer reads a sequence of vectors; for speech and sound the usual sequence is the
*log-mel spectrogram*: cut the wave into overlapping windows (the short-time Fourier transform),
keep the power in each frequency bin, pool the bins into triangular bands spaced evenly on the
*mel* scale (which follows how pitch is heard: nearly linear below 1 kHz, logarithmic above),
and take decibels. Each column (one *frame*, ``hop_length`` samples apart) becomes one token.

- ``hz_to_mel`` / ``mel_to_hz``: Slaney's piecewise linear/log mel scale (librosa's default) or
  HTK's ``2595 log10(1 + f / 700)``.
- ``mel_filterbank``: the triangular filters, equal to ``librosa.filters.mel`` (tested).
- ``mel_spectrogram`` / ``log_mel_spectrogram``: from ``torch.stft``, equal to
  ``librosa.feature.melspectrogram`` and ``librosa.power_to_db`` (tested).
- ``synthetic_audio``: six classes of short sounds (tones, chirps up and down, noise bursts,
  chords, tremolo) with random pitches, onsets and background noise; seeded, no download.
- ``ConformerBlock`` (Gulati et al. 2020, arXiv 2005.08100, fig. 1 and eq. 1): two half-step
  feed-forward modules sandwiching self-attention and a convolution module.
- ``spectrogram_transformer``: an AST-style ViT on spectrogram patches.
- ``ConformerClassifier``: mel frames as tokens, Conformer blocks, mean pool, a linear head.
- Training: ``tfedu.vision.fit_classifier`` and ``accuracy`` serve the audio models too.

Built by hand in notebooks/11_beyond_text.ipynb.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from tfedu.config import ModelConfig
from tfedu.layers import LayerNorm, dropout, make_attention
from tfedu.positional import sinusoidal
from tfedu.vision import ViT, ViTConfig, _positive_int, _positive_number  # (vision imports nothing from audio)

# Slaney's mel scale (Auditory Toolbox; librosa's default): linear, 200/3 Hz per mel, up to
# 1 kHz (= 15 mel), then logarithmic with 27 mel per factor 6.4 in frequency.
_SLANEY_HZ_PER_MEL = 200.0 / 3.0
_SLANEY_BREAK_HZ = 1000.0
_SLANEY_BREAK_MEL = _SLANEY_BREAK_HZ / _SLANEY_HZ_PER_MEL  # 15.0
_SLANEY_LOG_STEP = math.log(6.4) / 27.0

NORMS = ("slaney", None)


# ----------------------------------------------------------------------------- checks


def _check_wave(wave: object) -> None:
    if not isinstance(wave, torch.Tensor):
        raise ValueError(f"wave must be a torch.Tensor of shape (time,) or (batch, time), got {type(wave).__name__}")
    if not wave.is_floating_point():
        raise ValueError(
            f"wave must be a floating-point tensor of samples (e.g. in [-1, 1]), got dtype {wave.dtype}; "
            "16-bit PCM integers: divide by 32768.0 first"
        )
    if wave.dim() not in (1, 2):
        raise ValueError(f"wave must have shape (time,) or (batch, time), got shape {tuple(wave.shape)}")
    if wave.shape[-1] == 0:
        raise ValueError("wave has no samples (its last axis, time, has length 0)")


# ----------------------------------------------------------------------------- the mel scale


def hz_to_mel(freqs: Float[Tensor, "*shape"], *, htk: bool = False) -> Float[Tensor, "*shape"]:
    """Frequencies in Hz to mels: Slaney's scale (default) or HTK's ``2595 log10(1 + f / 700)``.

    Slaney's scale is linear below 1 kHz (1 mel = 200/3 Hz) and logarithmic above, which is how
    librosa computes it by default; HTK's is logarithmic everywhere. Both put 1000 Hz near the
    bend, so equal steps in mel are about equal steps in *heard* pitch.

    >>> hz_to_mel(torch.tensor([0.0, 500.0, 1000.0, 6400.0], dtype=torch.float64)).round(decimals=4)
    tensor([ 0.0000,  7.5000, 15.0000, 42.0000], dtype=torch.float64)
    >>> hz_to_mel(torch.tensor([1000.0], dtype=torch.float64), htk=True).round(decimals=4)
    tensor([999.9855], dtype=torch.float64)

    Built by hand in notebooks/11_beyond_text.ipynb.
    """
    if htk:
        return 2595.0 * torch.log10(1.0 + freqs / 700.0)
    linear = freqs / _SLANEY_HZ_PER_MEL
    # clamp keeps log() finite for the (discarded) branch at f <= 0.
    log = _SLANEY_BREAK_MEL + torch.log(freqs.clamp(min=1e-10) / _SLANEY_BREAK_HZ) / _SLANEY_LOG_STEP
    return torch.where(freqs >= _SLANEY_BREAK_HZ, log, linear)


def mel_to_hz(mels: Float[Tensor, "*shape"], *, htk: bool = False) -> Float[Tensor, "*shape"]:
    """Mels back to Hz: the inverse of ``hz_to_mel``.

    >>> mel_to_hz(torch.tensor([7.5, 15.0, 42.0], dtype=torch.float64)).round()
    tensor([ 500., 1000., 6400.], dtype=torch.float64)

    Built by hand in notebooks/11_beyond_text.ipynb.
    """
    if htk:
        return 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    linear = mels * _SLANEY_HZ_PER_MEL
    log = _SLANEY_BREAK_HZ * torch.exp(_SLANEY_LOG_STEP * (mels - _SLANEY_BREAK_MEL))
    return torch.where(mels >= _SLANEY_BREAK_MEL, log, linear)


def _filterbank(
    bin_freqs: Float[Tensor, "n_freqs"], n_mels: int, f_min: int | float, f_max: float, htk: bool, norm: str | None
) -> Float[Tensor, "n_mels n_freqs"]:
    """Triangular filters over FFT bins centred at ``bin_freqs`` (float64)."""
    # n_mels + 2 edges evenly spaced in mel: filter m rises from edge m to m+1 and falls to m+2.
    mel_edges = torch.linspace(
        float(hz_to_mel(torch.tensor(f_min, dtype=torch.float64), htk=htk)),
        float(hz_to_mel(torch.tensor(f_max, dtype=torch.float64), htk=htk)),
        n_mels + 2, dtype=torch.float64,
    )
    hz_edges = mel_to_hz(mel_edges, htk=htk)  # n_mels+2
    widths = hz_edges.diff()  # n_mels+1
    offsets = hz_edges[:, None] - bin_freqs[None, :]  # n_mels+2 n_freqs
    rising = -offsets[:-2] / widths[:-1, None]  # n_mels n_freqs: 0 at the lower edge, 1 at the centre
    falling = offsets[2:] / widths[1:, None]  # n_mels n_freqs: 1 at the centre, 0 at the upper edge
    triangles = torch.minimum(rising, falling)
    weights = torch.where(triangles > 0, triangles, 0.0)  # (not clamp: it would keep -0.0 and print it)
    if norm == "slaney":
        # Divide each triangle by half its width in Hz (area 1): wide high-frequency bands then
        # do not get more energy just for being wide (Slaney's Auditory Toolbox; librosa's default).
        weights = weights * (2.0 / (hz_edges[2:] - hz_edges[:-2]))[:, None]
    empty = (weights.amax(dim=1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"mel filter(s) {empty} of {n_mels} cover no FFT bin: n_mels={n_mels} bands between {f_min} and "
            f"{f_max} Hz are narrower than the bin spacing of {float(bin_freqs[1] - bin_freqs[0]):.4g} Hz; "
            "use fewer mel bands or a larger n_fft (librosa only warns 'Empty filters detected')"
        )
    return weights


def _check_filterbank_args(n_mels: object, sample_rate: object, f_min: object, f_max: object, norm: object) -> float:
    _positive_int("n_mels", n_mels)
    _positive_number("sample_rate", sample_rate)
    nyquist = sample_rate / 2
    f_max = nyquist if f_max is None else f_max
    for name, value in (("f_min", f_min), ("f_max", f_max)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= nyquist:
            raise ValueError(f"{name} must be a frequency in [0, sample_rate / 2 = {nyquist}] Hz, got {value!r}")
    if not f_min < f_max:
        raise ValueError(f"f_min must be below f_max, got f_min={f_min}, f_max={f_max}")
    if norm not in NORMS:
        raise ValueError(f"norm must be 'slaney' (area-normalised triangles) or None, got {norm!r}")
    return float(f_max)


def mel_filterbank(
    n_freqs: int, n_mels: int, sample_rate: int | float, f_min: int | float = 0.0, f_max: int | float | None = None, *,
    htk: bool = False, norm: str | None = "slaney",
) -> Float[Tensor, "n_mels n_freqs"]:
    """The mel filterbank: ``n_mels`` triangular filters over ``n_freqs`` FFT bins from 0 to sample_rate / 2.

    Filter m rises linearly (in Hz) from edge m to edge m+1 and falls back to 0 at edge m+2,
    where the ``n_mels + 2`` edges are evenly spaced in mel between ``f_min`` and ``f_max``
    (default: the Nyquist frequency). ``norm="slaney"`` scales filter m by
    ``2 / (f_{m+2} - f_m)`` so each has area 1; ``norm=None`` leaves peaks of 1. For
    ``n_fft`` even, ``n_freqs = n_fft // 2 + 1`` and this equals
    ``librosa.filters.mel(sr=sample_rate, n_fft=n_fft, ...)`` (tested). Multiply a power
    spectrum ``(n_freqs, frames)`` by it on the left to get the mel spectrum ``(n_mels, frames)``.
    Float64. Raises ValueError if a filter falls between two bins and is empty.

    >>> mel_filterbank(9, 3, sample_rate=8000, norm=None).round(decimals=2)  # bins 0, 500, ..., 4000 Hz
    tensor([[0.0000, 0.8500, 0.3200, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
            [0.0000, 0.0000, 0.6800, 0.6900, 0.1900, 0.0000, 0.0000, 0.0000, 0.0000],
            [0.0000, 0.0000, 0.0000, 0.3100, 0.8100, 0.8300, 0.5500, 0.2800, 0.0000]], dtype=torch.float64)

    Built by hand in notebooks/11_beyond_text.ipynb.
    """
    _positive_int("n_freqs", n_freqs)
    if n_freqs < 2:
        raise ValueError(f"n_freqs must be at least 2 (bins at 0 Hz and sample_rate / 2), got {n_freqs}")
    f_max = _check_filterbank_args(n_mels, sample_rate, f_min, f_max, norm)
    bin_freqs = torch.linspace(0.0, sample_rate / 2, n_freqs, dtype=torch.float64)  # n_freqs
    return _filterbank(bin_freqs, n_mels, float(f_min), f_max, htk, norm)


# ----------------------------------------------------------------------------- spectrograms


def mel_spectrogram(
    wave: Float[Tensor, "*batch time"], sample_rate: int | float, *, n_fft: int = 256, hop_length: int = 64,
    n_mels: int = 32, f_min: int | float = 0.0, f_max: int | float | None = None, power: int | float = 2.0,
    htk: bool = False, norm: str | None = "slaney", filterbank: Float[Tensor, "n_mels n_freqs"] | None = None,
) -> Float[Tensor, "*batch n_mels frames"]:
    """The mel spectrogram of ``wave`` (shape ``(time,)`` or ``(batch, time)``): STFT, ``|X|^power``, mel filters.

    The short-time Fourier transform uses a periodic Hann window of ``n_fft`` samples every
    ``hop_length`` samples, with the wave zero-padded by ``n_fft // 2`` on both sides so that
    frame t is centred on sample ``t * hop_length`` (``center=True``, ``pad_mode="constant"``:
    librosa 0.10+'s defaults). ``frames = 1 + time // hop_length``. The filterbank is
    ``mel_filterbank`` over the bins' frequencies ``k * sample_rate / n_fft``. Equal to
    ``librosa.feature.melspectrogram(y=wave, sr=sample_rate, n_fft=n_fft, hop_length=hop_length,
    n_mels=n_mels, fmin=f_min, fmax=f_max, power=power)`` (tested). Keeps the wave's dtype.
    ``filterbank`` (``(n_mels, n_fft // 2 + 1)``, e.g. one built by hand) replaces the built-in
    filters; ``n_mels``, ``f_min``, ``f_max``, ``htk`` and ``norm`` are then not used.

    >>> t = torch.arange(8000) / 8000
    >>> S = mel_spectrogram(torch.sin(2 * torch.pi * 1000 * t), 8000)  # 1 kHz, one second
    >>> S.shape, mel_frequencies(32, sample_rate=8000)[S[:, 60].argmax()].round()
    (torch.Size([32, 126]), tensor(995., dtype=torch.float64))

    Built by hand in notebooks/11_beyond_text.ipynb.
    """
    _check_wave(wave)
    _positive_int("n_fft", n_fft)
    _positive_int("hop_length", hop_length)
    _positive_number("power", power)
    if filterbank is None:
        f_max = _check_filterbank_args(n_mels, sample_rate, f_min, f_max, norm)
    window = torch.hann_window(n_fft, periodic=True, dtype=wave.dtype, device=wave.device)  # as scipy's "hann"
    spec = torch.stft(wave, n_fft, hop_length=hop_length, window=window, center=True, pad_mode="constant",
                      return_complex=True)  # *batch n_freqs frames
    spec = spec.abs() ** power
    if filterbank is None:
        bin_freqs = torch.fft.rfftfreq(n_fft, d=1.0 / sample_rate, dtype=torch.float64)  # exact for odd n_fft too
        fb = _filterbank(bin_freqs, n_mels, float(f_min), f_max, htk, norm)
    else:
        fb = filterbank
        if (not isinstance(fb, Tensor) or fb.dim() != 2 or fb.shape[1] != n_fft // 2 + 1
                or not fb.is_floating_point()):
            raise ValueError(f"filterbank must be a float tensor (n_mels, n_fft // 2 + 1) = (n_mels, {n_fft // 2 + 1}), "
                             f"got {type(fb).__name__} {tuple(getattr(fb, 'shape', ()))}")
    fb = fb.to(spec.dtype).to(wave.device)
    return torch.einsum("mf,...ft->...mt", fb, spec)  # *batch n_mels frames


def mel_frequencies(n_mels: int, *, sample_rate: int | float, f_min: int | float = 0.0, f_max: int | float | None = None,
                    htk: bool = False) -> Float[Tensor, "n_mels"]:
    """The centre frequency in Hz of each of ``mel_filterbank``'s ``n_mels`` filters (for axis labels).

    >>> mel_frequencies(3, sample_rate=8000).round()  # the centres of mel_filterbank's example
    tensor([ 586., 1194., 2186.], dtype=torch.float64)

    Built by hand in notebooks/11_beyond_text.ipynb.
    """
    f_max = _check_filterbank_args(n_mels, sample_rate, f_min, f_max, None)
    mel_edges = torch.linspace(
        float(hz_to_mel(torch.tensor(float(f_min), dtype=torch.float64), htk=htk)),
        float(hz_to_mel(torch.tensor(f_max, dtype=torch.float64), htk=htk)), n_mels + 2, dtype=torch.float64,
    )
    return mel_to_hz(mel_edges[1:-1], htk=htk)


def log_mel_spectrogram(
    wave: Float[Tensor, "*batch time"], sample_rate: int | float, *, n_fft: int = 256, hop_length: int = 64,
    n_mels: int = 32, f_min: int | float = 0.0, f_max: int | float | None = None, power: int | float = 2.0,
    htk: bool = False, norm: str | None = "slaney", amin: int | float = 1e-10, top_db: int | float | None = 80.0,
    filterbank: Float[Tensor, "n_mels n_freqs"] | None = None,
) -> Float[Tensor, "*batch n_mels frames"]:
    """``mel_spectrogram`` in decibels: ``10 log10(max(S, amin))`` for power 2, floored at ``top_db`` below each clip's peak.

    Loudness is heard roughly logarithmically, and a log squeezes the many orders of magnitude of
    a power spectrum into a range a network can digest. For ``power=p`` the factor is ``20 / p``
    (decibels of the amplitude). ``amin`` keeps the log finite on silence; ``top_db`` (None: off)
    clips everything more than ``top_db`` dB below the loudest value *of each clip*, so a batch
    item never depends on the others. For one clip and power 2 this is
    ``librosa.power_to_db(S, ref=1.0, amin=amin, top_db=top_db)`` of the mel spectrogram (tested).

    >>> t = torch.arange(4000) / 8000
    >>> db = log_mel_spectrogram(torch.sin(2 * torch.pi * 440 * t), 8000)
    >>> db.shape, float(db.max() - db.min())  # the floor: 80 dB below the peak
    (torch.Size([32, 63]), 80.0)

    Built by hand in notebooks/11_beyond_text.ipynb.
    """
    _positive_number("amin", amin)
    if top_db is not None and (isinstance(top_db, bool) or not isinstance(top_db, (int, float)) or top_db < 0):
        raise ValueError(f"top_db must be a non-negative number of decibels or None, got {top_db!r}")
    S = mel_spectrogram(wave, sample_rate, n_fft=n_fft, hop_length=hop_length, n_mels=n_mels, f_min=f_min,
                        f_max=f_max, power=power, htk=htk, norm=norm, filterbank=filterbank)
    db = (20.0 / power) * torch.log10(S.clamp(min=amin))  # *batch n_mels frames
    if top_db is not None:
        peak = db.amax(dim=(-2, -1), keepdim=True)  # *batch 1 1: each clip's own loudest bin
        db = torch.maximum(db, peak - top_db)
    return db


# ----------------------------------------------------------------------------- a synthetic data set


CLASS_NAMES = ("tone", "chirp_up", "chirp_down", "noise_burst", "chord", "tremolo")


@dataclass(frozen=True)
class AudioClips:
    """Labelled clips from ``synthetic_audio``: waves, labels, class names and where each sound sits."""

    waves: Float[Tensor, "n time"]  # samples, float32
    labels: Int[Tensor, "n"]  # index into class_names
    class_names: tuple[str, ...]
    sample_rate: int
    onsets: Float[Tensor, "n"]  # seconds from the start of the clip to the start of the sound
    offsets: Float[Tensor, "n"]  # seconds from the start of the clip to its end

    def __len__(self) -> int:
        return len(self.labels)


def _uniform(gen: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand((), generator=gen, dtype=torch.float64))


def _log_uniform(gen: torch.Generator, low: float, high: float) -> float:
    return math.exp(_uniform(gen, math.log(low), math.log(high)))


def _event(label: int, t: Tensor, gen: torch.Generator, f_low: int | float, f_high: int | float) -> Tensor:
    """One sound of class ``label`` at times ``t`` (seconds from its onset), before envelope and scaling."""
    length = float(t[-1]) if len(t) > 1 else 1.0
    name = CLASS_NAMES[label]
    if name in ("tone", "tremolo"):
        wave = torch.sin(2 * math.pi * _log_uniform(gen, f_low, f_high) * t)
        if name == "tremolo":
            # Amplitude modulation at 6-12 Hz, full depth: the loudness pulses, the pitch stays.
            rate = _uniform(gen, 6.0, 12.0)
            wave = wave * 0.5 * (1 - torch.cos(2 * math.pi * rate * t))
        return wave
    if name in ("chirp_up", "chirp_down"):
        # An exponential sweep over at least an octave: f(t) = f0 * k ** (t / T), a straight line
        # on the (roughly logarithmic) mel axis. Phase = 2 pi f0 T (k ** (t / T) - 1) / ln k.
        ratio = _uniform(gen, 2.0, 4.0)
        start = _log_uniform(gen, f_low, f_high / ratio)
        f0, k = (start, ratio) if name == "chirp_up" else (start * ratio, 1 / ratio)
        return torch.sin(2 * math.pi * f0 * length * (k ** (t / length) - 1) / math.log(k))
    if name == "noise_burst":
        return torch.randn(len(t), generator=gen, dtype=torch.float64)
    # chord: two tones a musical third to an octave apart (ratio 1.25-2).
    f0 = _log_uniform(gen, f_low, f_high / 2)
    f1 = f0 * _uniform(gen, 1.25, 2.0)
    return torch.sin(2 * math.pi * f0 * t) + torch.sin(2 * math.pi * f1 * t + _uniform(gen, 0, 2 * math.pi))


def synthetic_audio(
    n_per_class: int, *, seed: int = 0, sample_rate: int = 8000, duration: int | float = 0.5, snr_db: int | float = 10.0,
    f_low: int | float = 200.0, f_high: int | float = 3200.0,
) -> AudioClips:
    """A small, seeded data set of six sound classes: ``n_per_class`` clips each, shuffled.

    Classes (``CLASS_NAMES``): a steady ``tone``; a ``chirp_up`` and a ``chirp_down`` sweeping
    over one to two octaves; a white ``noise_burst``; a ``chord`` of two tones; a ``tremolo``
    (a tone whose loudness pulses 6-12 times a second). Pitches are drawn log-uniformly from
    ``[f_low, f_high]`` Hz; each sound lasts 40-80 % of the clip, starts at a random time, fades
    in and out over 10 ms (no clicks), and sits in white background noise ``snr_db`` decibels
    quieter than the sound. No two clips are the same, so a model must learn the *shape* of each
    class in the spectrogram (a chirp is a rising or falling line; a chord, two lines; ...), not
    memorise clips. Deterministic given ``seed``: a private ``torch.Generator``, never the global one.

    >>> clips = synthetic_audio(2, seed=0)
    >>> clips.waves.shape, clips.labels.bincount().tolist(), clips.class_names[:3]
    (torch.Size([12, 4000]), [2, 2, 2, 2, 2, 2], ('tone', 'chirp_up', 'chirp_down'))

    Built by hand in notebooks/11_beyond_text.ipynb.
    """
    _positive_int("n_per_class", n_per_class)
    _positive_int("sample_rate", sample_rate)
    _positive_number("duration", duration)
    if isinstance(snr_db, bool) or not isinstance(snr_db, (int, float)) or not math.isfinite(snr_db):
        raise ValueError(f"snr_db must be a finite number of decibels, got {snr_db!r}")
    if not 0 < f_low < f_high <= sample_rate / 2:
        raise ValueError(f"need 0 < f_low < f_high <= sample_rate / 2 = {sample_rate / 2}, got {f_low}, {f_high}")
    if f_high / f_low < 4:
        raise ValueError(f"f_high / f_low must be at least 4 (a chirp spans up to two octaves), got {f_high / f_low}")
    n_time = round(sample_rate * duration)
    if n_time < sample_rate * 0.05:
        raise ValueError(f"duration must be at least 0.05 s (the sounds need room to start and fade), got {duration}")
    gen = torch.Generator().manual_seed(seed)
    n_classes = len(CLASS_NAMES)
    labels = torch.arange(n_classes).repeat(n_per_class)
    labels = labels[torch.randperm(len(labels), generator=gen)]
    waves = torch.zeros(len(labels), n_time, dtype=torch.float64)
    onsets, offsets = torch.zeros(len(labels)), torch.zeros(len(labels))
    fade = max(1, round(0.01 * sample_rate))
    for i, label in enumerate(labels.tolist()):
        n_event = round(n_time * _uniform(gen, 0.4, 0.8))
        start = int(torch.randint(0, n_time - n_event + 1, (), generator=gen))
        t = torch.arange(n_event, dtype=torch.float64) / sample_rate
        event = _event(label, t, gen, f_low, f_high)
        ramp = 0.5 * (1 - torch.cos(math.pi * torch.arange(fade, dtype=torch.float64) / fade))  # raised cosine
        envelope = torch.ones(n_event, dtype=torch.float64)
        envelope[:fade], envelope[-fade:] = ramp, ramp.flip(0)
        event = event * envelope
        event = 0.5 * event / event.abs().max()  # every sound peaks at 0.5
        noise_rms = event.pow(2).mean().sqrt() / 10 ** (snr_db / 20)  # SNR over the sound's own span
        waves[i] = noise_rms * torch.randn(n_time, generator=gen, dtype=torch.float64)
        waves[i, start:start + n_event] += event
        onsets[i], offsets[i] = start / sample_rate, (start + n_event) / sample_rate
    return AudioClips(waves.float(), labels, CLASS_NAMES, sample_rate, onsets, offsets)


# ----------------------------------------------------------------------------- the Conformer


def _check_tokens(module: str, x: object, d_model: int) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 3 or x.shape[-1] != d_model:
        got = f"shape {tuple(x.shape)}, dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{module} expects a float tensor of shape (batch, pos, d_model={d_model}), got {got}")


def _check_padding_mask(mask: object, x: Tensor) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != tuple(x.shape[:2]):
        got = f"shape {tuple(mask.shape)}, dtype {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"mask must be a boolean tensor of shape (batch, pos) = {tuple(x.shape[:2])}, True = a real frame, "
            f"False = padding; got {got}"
        )


class ConformerFeedForward(nn.Module):
    """The Conformer's feed-forward module (Gulati et al. 2020, sec. 2.3, fig. 4).

    LayerNorm -> Linear(d_model, ff_mult * d_model) -> Swish (SiLU) -> dropout -> Linear -> dropout.
    Pre-norm inside the module; the *block* adds half of it to the residual stream.

    >>> ff = ConformerFeedForward(8)
    >>> ff.W_in, ff(torch.zeros(2, 5, 8)).shape
    (Linear(in_features=8, out_features=32, bias=True), torch.Size([2, 5, 8]))

    Built by hand in notebooks/11_beyond_text.ipynb.
    """

    def __init__(self, d_model: int, *, ff_mult: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        _positive_int("d_model", d_model)
        _positive_int("ff_mult", ff_mult)
        self.d_model = d_model
        self.norm = LayerNorm(d_model)
        self.W_in = nn.Linear(d_model, ff_mult * d_model)
        self.W_out = nn.Linear(ff_mult * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        hidden = dropout(self.drop, F.silu(self.W_in(self.norm(x))))  # batch pos d_mlp
        return dropout(self.drop, self.W_out(hidden))


class ConformerAttention(nn.Module):
    """The Conformer's self-attention module: LayerNorm -> multi-head self-attention -> dropout.

    The attention is the course's own ``tfedu.layers.Attention`` (built from a ``ModelConfig``),
    so its pattern can be read at ``self.attn.hook_pattern``. Gulati et al. 2020 (sec. 2.1) use
    Transformer-XL's *relative* sinusoidal positions inside the scores; we keep the attention
    position-free and add absolute positions to the tokens at the input (``ConformerClassifier``):
    one less idea for this notebook, and the convolution module already gives every block a
    precise sense of *local* order, which is what relative positions mostly buy for audio.
    ``mask`` (batch, pos) is True for real frames: padding frames are never attended to.

    >>> attn = ConformerAttention(8, n_heads=2)
    >>> attn(torch.zeros(2, 5, 8)).shape
    torch.Size([2, 5, 8])

    Built by hand in notebooks/11_beyond_text.ipynb.
    """

    def __init__(self, d_model: int, n_heads: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        cfg = ModelConfig(d_vocab=1, n_ctx=1, d_model=d_model, n_layers=1, n_heads=n_heads, positional="none",
                          dropout=dropout)
        self.d_model = d_model
        self.norm = LayerNorm(d_model)
        self.attn = make_attention(cfg)
        self.drop = nn.Dropout(dropout)

    def forward(
        self, x: Float[Tensor, "batch pos d_model"], mask: Bool[Tensor, "batch pos"] | None = None
    ) -> Float[Tensor, "batch pos d_model"]:
        keys = None if mask is None else mask[:, None, None, :]  # batch 1 1 key_pos: broadcast over heads, queries
        return dropout(self.drop, self.attn(self.norm(x), mask=keys))


class ConformerConvModule(nn.Module):
    """The Conformer's convolution module (Gulati et al. 2020, sec. 2.2, fig. 2).

    LayerNorm -> pointwise Conv1d(d, 2d) -> GLU over channels -> depthwise Conv1d (``kernel_size``
    taps, one filter per channel: ``groups = d_model``, zero 'same' padding) -> BatchNorm1d ->
    Swish (SiLU) -> pointwise Conv1d(d, d) -> dropout. Attention mixes all positions by content;
    the depthwise convolution mixes each channel over a fixed window of ``kernel_size`` frames
    around each position: the local patterns (onsets, formant slopes) that attention finds hard
    to pin down. Shifting the input in time shifts the output (away from the zero-padded edges).
    Padding frames (``mask`` False) are zeroed before the depthwise convolution so they do not
    leak into real frames (BatchNorm's batch statistics still count them in training).

    >>> conv = ConformerConvModule(8, kernel_size=3)
    >>> conv.depthwise
    Conv1d(8, 8, kernel_size=(3,), stride=(1,), padding=(1,), groups=8)
    >>> conv(torch.zeros(2, 5, 8)).shape
    torch.Size([2, 5, 8])

    Built by hand in notebooks/11_beyond_text.ipynb.
    """

    def __init__(self, d_model: int, *, kernel_size: int = 15, dropout: float = 0.0) -> None:
        super().__init__()
        _positive_int("d_model", d_model)
        _positive_int("kernel_size", kernel_size)
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd so 'same' padding is symmetric (k // 2 each side), got {kernel_size}")
        self.d_model = d_model
        self.kernel_size = kernel_size
        self.norm = LayerNorm(d_model)
        self.pointwise_in = nn.Conv1d(d_model, 2 * d_model, kernel_size=1)
        self.depthwise = nn.Conv1d(d_model, d_model, kernel_size, padding=kernel_size // 2, groups=d_model)
        self.batch_norm = nn.BatchNorm1d(d_model)
        self.pointwise_out = nn.Conv1d(d_model, d_model, kernel_size=1)
        self.drop = nn.Dropout(dropout)

    def forward(
        self, x: Float[Tensor, "batch pos d_model"], mask: Bool[Tensor, "batch pos"] | None = None
    ) -> Float[Tensor, "batch pos d_model"]:
        h = self.norm(x).transpose(1, 2)  # batch d_model pos: Conv1d wants channels first
        # GLU (Dauphin et al. 2017): half the 2d channels gate the other half through a sigmoid.
        h = F.glu(self.pointwise_in(h), dim=1)  # batch d_model pos
        if mask is not None:
            h = h.masked_fill(~mask[:, None, :], 0.0)
        h = F.silu(self.batch_norm(self.depthwise(h)))  # batch d_model pos
        return dropout(self.drop, self.pointwise_out(h).transpose(1, 2))  # batch pos d_model


class ConformerBlock(nn.Module):
    """One Conformer block (Gulati et al. 2020, fig. 1 and eq. 1): a feed-forward "macaron" around attention and convolution.

    ::

        x' = x + 1/2 FFN(x)              ff1, half a step (eq. 1: the macaron-net split of Lu et al. 2019)
        x''  = x' + MHSA(x')             attn
        x''' = x'' + Conv(x'')           conv   (left out with conv=False)
        y  = LayerNorm(x''' + 1/2 FFN(x'''))  ff2, then norm_out

    Each module norms its own input (pre-norm); the two half-step FFNs replace the one full
    FFN of a Transformer block, which the paper's ablation (table 5) found better.

    >>> block = ConformerBlock(16, n_heads=2, kernel_size=5)
    >>> block(torch.randn(2, 7, 16)).shape
    torch.Size([2, 7, 16])
    >>> [name for name, _ in block.named_children()]
    ['ff1', 'attn', 'conv', 'ff2', 'norm_out']

    Built by hand in notebooks/11_beyond_text.ipynb.
    """

    def __init__(self, d_model: int, n_heads: int, *, kernel_size: int = 15, ff_mult: int = 4, dropout: float = 0.0,
                 conv: bool = True) -> None:
        super().__init__()
        self.d_model = d_model
        self.ff1 = ConformerFeedForward(d_model, ff_mult=ff_mult, dropout=dropout)
        self.attn = ConformerAttention(d_model, n_heads, dropout=dropout)
        self.conv = ConformerConvModule(d_model, kernel_size=kernel_size, dropout=dropout) if conv else None
        self.ff2 = ConformerFeedForward(d_model, ff_mult=ff_mult, dropout=dropout)
        self.norm_out = LayerNorm(d_model)

    def forward(
        self, x: Float[Tensor, "batch pos d_model"], mask: Bool[Tensor, "batch pos"] | None = None
    ) -> Float[Tensor, "batch pos d_model"]:
        _check_tokens("ConformerBlock", x, self.d_model)
        _check_padding_mask(mask, x)
        x = x + 0.5 * self.ff1(x)  # eq. 1, first line: half-step FFN
        x = x + self.attn(x, mask)
        if self.conv is not None:
            x = x + self.conv(x, mask)
        x = x + 0.5 * self.ff2(x)
        return self.norm_out(x)


def spectrogram_transformer(
    n_mels: int, n_frames: int, n_classes: int, *, patch_size: tuple[int, int] = (8, 4), d_model: int = 32,
    n_layers: int = 2, n_heads: int = 2, attention: str = "sdpa",
) -> ViT:
    """An AST-style classifier (Gong et al. 2021): the course's ``ViT`` on a one-channel spectrogram image.

    The log-mel spectrogram ``(n_mels, n_frames)`` is the image; ``patch_size`` (mel bands, frames)
    cuts it into non-overlapping patches (AST's own are 16x16 with a stride of 10, overlapping).
    Feed it ``(batch, 1, n_mels, n_frames)``, standardised (AST normalises its inputs too).

    >>> model = spectrogram_transformer(32, 16, 6)
    >>> model(torch.randn(2, 1, 32, 16)).shape, model.cfg.n_patches
    (torch.Size([2, 6]), 16)

    Built in notebooks/11_beyond_text.ipynb (as ``ViT(ViTConfig(...))``).
    """
    return ViT(ViTConfig(image_size=(n_mels, n_frames), patch_size=patch_size, in_channels=1, n_classes=n_classes,
                         d_model=d_model, n_layers=n_layers, n_heads=n_heads, attention=attention))


class ConformerClassifier(nn.Module):
    """A small Conformer that labels a whole clip from its log-mel spectrogram.

    Input ``(batch, n_mels, frames)`` (what ``log_mel_spectrogram`` returns): each frame is a
    token. BatchNorm over the mel bins puts the decibels on a unit scale (``norm_in``), a linear
    layer projects each frame to ``d_model`` (``embed``), fixed sinusoidal positions are added
    (Vaswani et al. 2017, sec. 3.5; any number of frames), ``n_layers`` ``ConformerBlock``\\s
    follow, then the mean over real frames and a linear ``head`` to ``n_classes`` logits.
    ``conv=False`` leaves the convolution module out of every block (the ablation of notebook 11).
    ``mask`` (batch, frames) is True for real frames, False for padding. The defaults are sized to
    train on ``synthetic_audio`` in seconds on one CPU thread, with frames of
    ``log_mel_spectrogram(waves, 8000, n_fft=512, hop_length=256)`` (32 ms apart: a clip of
    0.5 s is 16 tokens, and ``kernel_size=7`` frames span 224 ms, the length of a short chirp).

    >>> model = ConformerClassifier(n_mels=32, n_classes=6)
    >>> model(torch.randn(4, 32, 16)).shape
    torch.Size([4, 6])

    Built by hand in notebooks/11_beyond_text.ipynb.
    """

    def __init__(self, n_mels: int, n_classes: int, *, d_model: int = 32, n_layers: int = 2, n_heads: int = 4,
                 kernel_size: int = 7, ff_mult: int = 2, dropout: float = 0.0, conv: bool = True) -> None:
        super().__init__()
        _positive_int("n_mels", n_mels)
        _positive_int("n_classes", n_classes)
        _positive_int("n_layers", n_layers)
        if d_model % 2:
            raise ValueError(f"d_model must be even (sinusoidal positions pair sin and cos), got {d_model}")
        self.n_mels = n_mels
        self.d_model = d_model
        self.norm_in = nn.BatchNorm1d(n_mels)
        self.embed = nn.Linear(n_mels, d_model)
        self.blocks = nn.ModuleList(
            ConformerBlock(d_model, n_heads, kernel_size=kernel_size, ff_mult=ff_mult, dropout=dropout, conv=conv)
            for _ in range(n_layers)
        )
        self.head = nn.Linear(d_model, n_classes)

    def forward(
        self, spec: Float[Tensor, "batch n_mels frames"], mask: Bool[Tensor, "batch frames"] | None = None
    ) -> Float[Tensor, "batch n_classes"]:
        if not isinstance(spec, torch.Tensor) or not spec.is_floating_point() or spec.dim() != 3 \
                or spec.shape[1] != self.n_mels:
            got = f"shape {tuple(spec.shape)}, dtype {spec.dtype}" if isinstance(spec, torch.Tensor) else type(spec).__name__
            raise ValueError(
                f"ConformerClassifier expects a float spectrogram of shape (batch, n_mels={self.n_mels}, frames), "
                f"got {got}; one clip's (n_mels, frames) needs a batch axis: spec[None]"
            )
        x = self.embed(self.norm_in(spec).transpose(1, 2))  # batch frames d_model
        x = x + sinusoidal(x.shape[1], self.d_model, dtype=x.dtype, device=x.device)
        for block in self.blocks:
            x = block(x, mask)
        if mask is None:
            pooled = x.mean(dim=1)  # batch d_model
        else:
            weights = mask.to(x.dtype)[..., None]  # batch frames 1
            pooled = (x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)
        return self.head(pooled)  # batch n_classes
