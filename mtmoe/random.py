"""Per-trial counter-based random streams (issue 25): every random draw in training is a pure function of the
trial's ``seed``, the draw ``site``, the trial's own training ``step`` and the element's ``position``.

A trial's draws then depend on nothing else: not on its slot in a pack, its neighbours, the pack size or the
refill timing, and the unpacked ``fit`` draws the same bits. ``seed`` and ``step`` are int64 tensors (0-d for one
trial, buffers of its model; per-trial under ``torch.func.vmap``), so the draws of all trials are one computation on
the device, with no host reads.

The generator (:func:`random_bits`, 32 bits per position) is a keyed counter-mode construction in the sense of
Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC'11): a keyed bijection applied to a counter.

* The permutation ``H`` is ``lowbias32`` from Chris Wellons' hash-prospector
  (https://github.com/skeeto/hash-prospector, README, "lowbias32"): a bijection of 32-bit values, two
  xorshift-multiply rounds whose constants were found by searching for low avalanche bias (every input bit flips
  every output bit with probability close to 1/2).
* The key, 64 bits as two 32-bit lanes, absorbs the 32-bit words ``seed_lo, seed_hi, step_lo, step_hi`` (the
  int64 tensors' two's-complement halves) by ``s <- H(s ^ word)``, each lane from its own initial value
  ``H(2 site + lane)``: the lanes ``(k1, k2)`` are two unrelated functions of ``(seed, site, step)``.
* A position's bits are ``H(H(position ^ k1) ^ k2)``: the two-round key-alternating (iterated Even-Mansour)
  structure over the public permutation ``H`` (Even and Mansour, J. Cryptology 1997; Bogdanov et al.,
  EUROCRYPT 2012). For one key it is a permutation of the 2^32 positions (no value repeats within a stream); the
  streams of two keys have no simple relation, whereas with a single ``H(position ^ key)`` two keys would give
  the same values at shuffled positions.

:func:`dropout` takes two decisions from each 32-bit word (its 16-bit halves); :func:`uniform`, :func:`gumbel`
and :func:`bernoulli` take one word per element. The statistics (uniformity of the bits, independence of
neighbouring positions and across seeds, steps and sites) are checked in ``tests/test_random.py``.

Three implementations give bitwise identical bits: the torch reference (int64 tensor operations, each exact: 32-bit
values are masked before every multiplication and the multiplier ``0x846ca68b`` is used as ``0x846ca68b - 2^32``,
so no product leaves int64; it vmaps, runs on any device, reads nothing on the host and has no data-dependent
shape, so it can be captured in a CUDA graph), a numba kernel for CPU tensors and a Triton kernel for CUDA tensors
(the latter two for :func:`dropout`, in uint32 arithmetic). CI runs the Triton kernel on CPU tensors in Triton's
interpreter (``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch
from numba.core import types as numba_types
from numba.extending import intrinsic
from torch import Tensor

from mtmoe.host_threads import run_split
from mtmoe.kernel_traffic import fused_kernel
from mtmoe.plain_kernels import runs_fused
from mtmoe.triton_support import INTERPRET, grid, tl, triton, use_triton

_LOW32 = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
_M2_SIGNED = _M2 - 2**32  # the same product modulo 2^32, and |x * _M2_SIGNED| < 2^63 for 32-bit x
MAX_SITE = 2**31  # sites are 0 <= site < 2^31: the lanes' initial values H(2 site + lane) are distinct
MAX_POSITIONS = 2**32


def _lowbias32(x):
    """``lowbias32`` (hash-prospector) of 32-bit values held in int64 tensors or Python ints; exact in int64."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _LOW32
    x = x ^ (x >> 15)
    x = (x * _M2_SIGNED) & _LOW32
    return x ^ (x >> 16)


def _initial_lanes(site: int) -> tuple[int, int]:
    """The key lanes' initial values for ``site``: ``H(2 site)`` and ``H(2 site + 1)``."""
    if not 0 <= site < MAX_SITE:
        raise ValueError(f"a draw site must be an int in [0, 2^31), got {site!r}")
    return _lowbias32(2 * site), _lowbias32(2 * site + 1)


def _words(value: Tensor) -> tuple[Tensor, Tensor]:
    """The low and high 32-bit halves of an int64 tensor's two's-complement bits."""
    return value & _LOW32, (value >> 32) & _LOW32


def _keys(seed: Tensor, site: int, step: Tensor) -> tuple[Tensor, Tensor]:
    """The two 32-bit key lanes of ``(seed, site, step)``, shaped as ``seed`` and ``step`` broadcast."""
    iv0, iv1 = _initial_lanes(site)
    state = torch.arange(2, device=seed.device) * (iv1 - iv0) + iv0
    for word in (*_words(seed), *_words(step)):
        state = _lowbias32(state ^ word.unsqueeze(-1))
    return state[..., 0], state[..., 1]


def random_bits(seed: Tensor, site: int, step: Tensor, position: Tensor) -> Tensor:
    """32 random bits (an int64 tensor in [0, 2^32)) for each ``position`` (int64 in [0, 2^32)) of the stream
    ``(seed, site, step)``; ``seed``, ``step`` (int64) and ``position`` broadcast together. The torch reference."""
    if seed.dtype != torch.int64 or step.dtype != torch.int64:
        raise TypeError(f"seed and step must be int64 tensors, got {seed.dtype} and {step.dtype}")
    k1, k2 = _keys(seed, site, step)
    return _lowbias32(_lowbias32(position ^ k1) ^ k2)


def _positions(shape: tuple[int, ...] | torch.Size, device: torch.device | str) -> Tensor:
    """Flat indices ``0 .. numel - 1`` viewed as ``shape``."""
    numel = math.prod(shape)
    if numel > MAX_POSITIONS:
        raise ValueError(f"a stream has 2^32 positions, {tuple(shape)} needs {numel}")
    return torch.arange(numel, device=device).view(shape)


def _precision(dtype: torch.dtype) -> int:
    """The significand bits of a floating dtype (24 for float32)."""
    return 1 - round(math.log2(torch.finfo(dtype).eps))


def uniform(seed: Tensor, site: int, step: Tensor, shape: tuple[int, ...], device: torch.device | str,
            dtype: torch.dtype = torch.float64) -> Tensor:
    """Uniforms in [0, 1) of ``shape``, element ``i`` (flat index) from ``random_bits(..., i)``: its top ``d`` bits
    times 2^-d, where ``d`` is ``dtype``'s precision (at most 32), so every value is exact in ``dtype``.
    Per-trial under vmap (``seed``, ``step`` per trial)."""
    digits = min(32, _precision(dtype))
    bits = random_bits(seed, site, step, _positions(shape, device))
    return (bits >> (32 - digits)).to(dtype) * 2.0**-digits


def gumbel(seed: Tensor, site: int, step: Tensor, shape: tuple[int, ...], device: torch.device | str,
           dtype: torch.dtype = torch.float64) -> Tensor:
    """Standard Gumbel noise ``-log(E)`` with ``E = -log(u) ~ Exponential(1)`` (Gumbel-max sampling), computed in
    float64 for a float64 ``dtype``, else in float32, then cast. ``u = (k + 1/2) 2^-d`` with ``k`` the top ``d``
    bits of ``random_bits(..., i)``, ``d`` one less than the computing dtype's precision (at most 32): ``u`` is
    exact and strictly inside (0, 1), so every value is finite."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    digits = min(32, _precision(compute) - 1)
    bits = random_bits(seed, site, step, _positions(shape, device))
    u = ((bits >> (32 - digits)).to(compute) + 0.5) * 2.0**-digits
    return (-(-u.log()).log()).to(dtype)


def bernoulli(seed: Tensor, site: int, step: Tensor, shape: tuple[int, ...], p: float,
              device: torch.device | str) -> Tensor:
    """Boolean coins of ``shape``, true with probability ``round(p 2^32) / 2^32``: ``random_bits < round(p 2^32)``
    (exact for every dtype and device)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"a probability must be in [0, 1], got {p}")
    return random_bits(seed, site, step, _positions(shape, device)) < round(p * 2**32)


def dropout_threshold(p: float) -> int:
    """The 16-bit threshold ``round(65536 p)``: an element is kept when its 16 bits are at least this, i.e. with
    probability ``1 - round(65536 p) / 65536`` (exact for p = 0.5 and every multiple of 2^-16)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return round(p * 65536)


def dropout_scale(p: float) -> float:
    """The kept elements' multiplier, ``1 / (1 - p)`` rounded to float32 (for every dtype of ``h``)."""
    return float(np.float32(1.0 / (1.0 - p)))


def dropout_reference(h: Tensor, seed: Tensor, site: int, step: Tensor, p: float) -> Tensor:
    """:func:`dropout` in torch operations (the reference): ``(h * keep) * dropout_scale(p)``.

    ``seed`` and ``step`` (broadcast together) index the trials along ``h``'s leading dimensions, so
    ``h.shape[:seed.dim()]`` is their shape; each trial's elements are numbered by their flat index in the rest.
    """
    trials = torch.broadcast_shapes(seed.shape, step.shape)
    shape = h.shape[len(trials):]
    if h.shape[:len(trials)] != trials:
        raise ValueError(f"h {tuple(h.shape)} does not start with the trials' shape {tuple(trials)}")
    numel = math.prod(shape)
    words = random_bits(seed.unsqueeze(-1), site, step.unsqueeze(-1), _positions(((numel + 1) // 2,), h.device))
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1).flatten(-2)[..., :numel]
    keep = (halves >= dropout_threshold(p)).reshape(*trials, *shape)
    return (h * keep) * dropout_scale(p)


# ---- numba (CPU tensors) -------------------------------------------------------------------------------------------

_CHUNK = 1024  # words hashed per pass: the passes stay in L1
_U32_M1, _U32_M2 = np.uint32(_M1), np.uint32(_M2)
_NO_TRIAL = np.uint32(0xFFFFFFFF)  # the trial of a key not derived yet


@numba.njit(cache=True, inline="always")
def _lowbias32_passes(words: np.ndarray, count: int) -> None:
    """``lowbias32`` of ``words[:count]`` (uint32, in place), one loop per round: each loop loads and stores uint32,
    which is what lets LLVM keep 32-bit SIMD lanes (numba computes with 64-bit integers)."""
    for j in range(count):
        x = words[j]
        words[j] = (x ^ (x >> np.uint32(16))) * _U32_M1
    for j in range(count):
        x = words[j]
        words[j] = (x ^ (x >> np.uint32(15))) * _U32_M2
    for j in range(count):
        x = words[j]
        words[j] = x ^ (x >> np.uint32(16))


@numba.njit(cache=True, inline="always")
def _derive_keys(lanes: np.ndarray, seed: int, step: int, iv0: int, iv1: int) -> None:
    """The key lanes of ``(seed, site, step)`` into ``lanes[:2]`` (uint32), from the site's initial values."""
    lanes[0], lanes[1] = np.uint32(iv0), np.uint32(iv1)
    for word in (seed & _LOW32, (seed >> 32) & _LOW32, step & _LOW32, (step >> 32) & _LOW32):
        lanes[0] ^= np.uint32(word)
        lanes[1] ^= np.uint32(word)
        _lowbias32_passes(lanes, 2)


@numba.njit(cache=True, inline="always")
def _stream(words: np.ndarray, count: int, first: int, k1: np.uint32, k2: np.uint32) -> None:
    """``words[:count]`` = the bits of positions ``first .. first + count - 1`` under the key ``(k1, k2)``."""
    for j in range(count):
        words[j] = np.uint32(first + j) ^ k1
    _lowbias32_passes(words, count)
    for j in range(count):
        words[j] ^= k2
    _lowbias32_passes(words, count)


@numba.njit(cache=True, inline="always")
def _scale_chunk(values: np.ndarray, out: np.ndarray, words: np.ndarray, threshold: np.uint32,
                 scale: np.float32) -> None:
    """``out = values * (keep * scale)``: element ``i`` is kept when the 16-bit half ``i & 1`` of ``words[i >> 1]``
    is at least ``threshold``. The multiplier is formed without a branch (random branches would be mispredicted
    half the time)."""
    m = values.shape[0]
    for j in range(m // 2):
        x = words[j]
        out[2 * j] = values[2 * j] * (scale * np.float32((x & np.uint32(0xFFFF)) >= threshold))
        out[2 * j + 1] = values[2 * j + 1] * (scale * np.float32((x >> np.uint32(16)) >= threshold))
    if m % 2:
        out[m - 1] = values[m - 1] * (scale * np.float32((words[m // 2] & np.uint32(0xFFFF)) >= threshold))


@numba.njit(cache=True, inline="always")
def _scratch() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A stream kernel's buffers: the key (uint32 [3]: its two lanes and the trial they are of, none yet), the words
    of one pass, and a chunk of float32 values with their bits (where a bfloat16 kernel widens a chunk,
    :func:`_widen`)."""
    key = np.empty(3, np.uint32)
    key[2] = _NO_TRIAL
    values = np.empty(2 * _CHUNK, np.float32)
    return key, np.empty(_CHUNK, np.uint32), values, values.view(np.uint32)


@numba.njit(cache=True, inline="always")
def _widen(bits: np.ndarray, value_bits: np.ndarray) -> None:
    """``value_bits[:len(bits)]`` = the float32 bits of the bfloat16 values of bits ``bits`` (exact)."""
    for j in range(bits.shape[0]):
        value_bits[j] = np.uint32(bits[j]) << np.uint32(16)


@numba.njit(cache=True, inline="always")
def _narrow(value_bits: np.ndarray, out: np.ndarray) -> None:
    """``out`` = the bfloat16 bits of the float32 values of bits ``value_bits[:len(out)]`` (:func:`_bfloat16_bits`)."""
    for j in range(out.shape[0]):
        out[j] = _bfloat16_bits(value_bits[j])


@numba.njit(cache=True, inline="always")
def _chunks(n: int) -> int:
    """Work units of one trial's ``n`` elements: chunks of ``2 * _CHUNK`` elements, the words of one pass."""
    return (n + 2 * _CHUNK - 1) // (2 * _CHUNK)


@numba.njit(cache=True, inline="always")
def _unit_words(unit: int, n: int, key: np.ndarray, words: np.ndarray, seeds: np.ndarray, steps: np.ndarray,
                iv0: int, iv1: int) -> tuple[int, int, int]:
    """Work unit ``unit`` of a ``[T, n]`` tensor (chunks of ``2 * _CHUNK`` elements, the words of one pass): its
    trial ``t``, first element and length, with its stream's words in ``words``; ``key`` (:func:`_scratch`) is
    derived again when ``t`` is another trial than the one it is of."""
    chunks = _chunks(n)
    t = unit // chunks
    start = (unit - t * chunks) * 2 * _CHUNK
    m = min(2 * _CHUNK, n - start)
    if t != key[2]:
        _derive_keys(key, seeds[t], steps[t], iv0, iv1)
        key[2] = t
    _stream(words, (m + 1) // 2, start // 2, key[0], key[1])
    return t, start, m


@numba.njit(cache=True, nogil=True)
def _dropout_cpu(h: np.ndarray, out: np.ndarray, seeds: np.ndarray, steps: np.ndarray, iv0: int, iv1: int,
                 threshold: np.uint32, scale: np.float32, lo: int, hi: int) -> None:
    """:func:`_scale_chunk` of the work units ``[lo, hi)`` (:func:`_unit_words`) of ``h`` ``[T, n]`` (float32 or
    float64), each trial ``t`` with the words of its stream: one pass over ``h``."""
    n = h.shape[1]
    key, words, _, _ = _scratch()
    for unit in range(lo, hi):
        t, start, m = _unit_words(unit, n, key, words, seeds, steps, iv0, iv1)
        _scale_chunk(h[t, start:start + m], out[t, start:start + m], words, threshold, scale)


@numba.njit(cache=True, inline="always")
def _bfloat16_bits(b: np.uint32) -> np.uint16:
    """The bfloat16 bits of the float32 value with bits ``b``, rounded to nearest even (NaN stays NaN), as torch
    rounds."""
    rounded = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.uint16(np.uint32(0x7FC0) if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rounded)


@intrinsic
def _fma(typingctx, a, b, c):
    """``a * b + c`` rounded once (LLVM's ``fma``), as torch's vectorised ``lerp`` and a GEMM's accumulation
    compute it."""
    if not all(isinstance(x, numba_types.Float) and x == a for x in (a, b, c)):
        return None

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return a(a, b, c), codegen


def _fuse_interpreter_fma() -> bool:
    """Under Triton's interpreter (the tests, ``gpu_check.py --dry-run``), ``tl.fma`` of float32 and float64 rounded
    once, as a GPU and the CPU kernels' :func:`_fma` compute it: the interpreter of Triton 3.8 and before computes
    ``x * y + z`` with two roundings. Probed first (``(1 + 2^-12)^2 - (1 + 2^-11)`` is ``2^-24`` fused, ``0`` not),
    left alone where it already fuses (Triton 3.9) or the probe does not run. Whether it was replaced."""
    from triton.runtime import interpreter

    unfused = interpreter.InterpreterBuilder.create_fma
    try:
        x = interpreter.TensorHandle(np.array([1 + 2**-12], np.float32), tl.float32)
        z = interpreter.TensorHandle(np.array([-(1 + 2**-11)], np.float32), tl.float32)
        if unfused(None, x, x, z).data[0] != 0:
            return False
    except Exception:  # another interpreter's internals: leave it as it is
        return False

    @numba.vectorize(["float32(float32, float32, float32)", "float64(float64, float64, float64)"])
    def fma_arrays(a, b, c):  # pragma: no cover - compiled; made here, only where the interpreter needs it
        return _fma(a, b, c)

    def create_fma(self, x, y, z):
        arrays = [np.asarray(handle.data) for handle in (x, y, z)]
        if arrays[2].dtype in (np.float32, np.float64) and all(a.dtype == arrays[2].dtype for a in arrays):
            return interpreter.TensorHandle(fma_arrays(*arrays), z.dtype.scalar)
        return unfused(self, x, y, z)

    interpreter.InterpreterBuilder.create_fma = create_fma
    return True


if INTERPRET and triton is not None:
    _fuse_interpreter_fma()


@numba.njit(cache=True, nogil=True)
def _dropout_cpu_bfloat16(h: np.ndarray, out: np.ndarray, seeds: np.ndarray, steps: np.ndarray, iv0: int, iv1: int,
                          threshold: np.uint32, scale: np.float32, lo: int, hi: int) -> None:
    """:func:`_dropout_cpu` of bfloat16 values given as their uint16 bits: each chunk widened to float32 (exact),
    scaled, and rounded back to nearest even (NaN stays NaN), as torch computes bfloat16 products."""
    n = h.shape[1]
    key, words, values, value_bits = _scratch()
    for unit in range(lo, hi):
        t, start, m = _unit_words(unit, n, key, words, seeds, steps, iv0, iv1)
        _widen(h[t, start:start + m], value_bits)
        _scale_chunk(values[:m], values[:m], words, threshold, scale)
        _narrow(value_bits, out[t, start:start + m])


# ---- Triton (CUDA tensors) -----------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _lowbias32_triton(x):
        """``lowbias32`` of uint32 values (products truncated to 32 bits whatever the constants' inferred type)."""
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D).to(tl.uint32)
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B).to(tl.uint32)
        return x ^ (x >> 16)

    @triton.jit
    def _absorb(lane, word):
        """One step of the key schedule: ``H(lane ^ word)`` for an int64 ``word`` in [0, 2^32)."""
        return _lowbias32_triton(lane ^ word.to(tl.uint32))

    @triton.jit
    def _keep_multiplier(seed_ptr, step_ptr, trial, offsets, iv0, iv1, threshold, scale):
        """Dropout's multiplier of the elements ``offsets`` (flat indices) of trial ``trial``: ``scale`` where kept,
        else 0 (:func:`dropout_reference`'s mask)."""
        seed = tl.load(seed_ptr + trial)
        step = tl.load(step_ptr + trial)
        k1 = iv0.to(tl.uint32)
        k2 = iv1.to(tl.uint32)
        k1 = _absorb(_absorb(_absorb(_absorb(k1, seed & 0xFFFFFFFF), (seed >> 32) & 0xFFFFFFFF),
                             step & 0xFFFFFFFF), (step >> 32) & 0xFFFFFFFF)
        k2 = _absorb(_absorb(_absorb(_absorb(k2, seed & 0xFFFFFFFF), (seed >> 32) & 0xFFFFFFFF),
                             step & 0xFFFFFFFF), (step >> 32) & 0xFFFFFFFF)
        bits = _lowbias32_triton(_lowbias32_triton((offsets >> 1).to(tl.uint32) ^ k1) ^ k2)
        half_bits = (bits >> ((offsets & 1) * 16).to(tl.uint32)) & 0xFFFF
        return tl.where(half_bits.to(tl.int32) >= threshold, scale, 0.0)

    @triton.jit
    def _widened(x, FLOAT64: tl.constexpr, BFLOAT16: tl.constexpr):
        """Loaded values in the compute dtype: float64, or float32 (bfloat16 widened by hand: Triton's interpreter
        gets bfloat16 subnormals and ties wrong)."""
        if FLOAT64:
            x = x.to(tl.float64)
        elif BFLOAT16:
            x = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _rounded(x, BFLOAT16: tl.constexpr):
        """Computed values as stored: float32 rounded to bfloat16 (to nearest even, by hand) for a bfloat16 output,
        else as they are."""
        if BFLOAT16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = tl.where(x != x, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1))
            x = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return x

    # the sizes are specialised (an int divisible by 16 or not): 128-bit loads and stores
    @triton.jit(do_not_specialize=["iv0", "iv1", "threshold"])
    def _dropout_cuda(h_ptr, out_ptr, seed_ptr, step_ptr, n, iv0, iv1, threshold, scale, BLOCK: tl.constexpr,
                      FLOAT64: tl.constexpr, BFLOAT16: tl.constexpr):
        """Program ``(block, trial)``: :func:`_dropout_cpu` on ``BLOCK`` elements of trial ``trial``."""
        trial = tl.program_id(1).to(tl.int64)
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        multiplier = _keep_multiplier(seed_ptr, step_ptr, trial, offsets, iv0, iv1, threshold, scale)
        h = _widened(tl.load(h_ptr + trial * n + offsets, mask=inside, other=0.0), FLOAT64, BFLOAT16)
        out = _rounded(h * multiplier, BFLOAT16)
        tl.store(out_ptr + trial * n + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)


_BLOCK = 1024


def stream_arguments(seed: Tensor | None, step: Tensor | None, trials: tuple[int, ...], site: int,
                     device: torch.device | None = None) -> tuple[Tensor, Tensor, int, int]:
    """What the dropout kernels take of the streams of ``trials`` trials: each trial's seed and step (int64,
    contiguous) and the site's two initial key lanes; with ``seed`` ``None`` (a kernel that drops nothing out, and
    reads none of it), zeros on ``device`` and lanes 0."""
    count = math.prod(trials)
    if seed is None:
        zeros = torch.zeros(count, dtype=torch.int64, device=device)
        return zeros, zeros, 0, 0
    seeds = seed.expand(trials).reshape(count).contiguous()
    steps = step.expand(trials).reshape(count).contiguous()
    return seeds, steps, *_initial_lanes(site)


def triton_lanes(iv0: int, iv1: int) -> tuple[int, int]:
    """The initial lanes' bits as int32: one kernel signature for every site (Triton types a Python int by its
    value, i64 from 2^31)."""
    return tuple(lane - 2**32 if lane >= 2**31 else lane for lane in (iv0, iv1))


def _dropout_kernel(h: Tensor, seed: Tensor, step: Tensor, site: int, p: float) -> Tensor:
    """:func:`dropout_reference`'s output, by the Triton kernel (CUDA), the numba kernel (CPU) or the reference."""
    trials = torch.broadcast_shapes(seed.shape, step.shape)
    if h.shape[:len(trials)] != trials:
        raise ValueError(f"h {tuple(h.shape)} does not start with the trials' shape {tuple(trials)}")
    count, n = math.prod(trials), math.prod(h.shape[len(trials):])
    if (n + 1) // 2 > MAX_POSITIONS:
        raise ValueError(f"a trial's stream has 2^32 words (two dropout decisions each), {n} elements need more")
    if not runs_fused("dropout", h.device) or h.numel() == 0:
        return dropout_reference(h, seed, site, step, p)
    seeds, steps, iv0, iv1 = stream_arguments(seed, step, trials, site)
    threshold, scale = dropout_threshold(p), dropout_scale(p)
    h = h.detach().contiguous()
    if use_triton(h.device):
        fused_kernel("dropout (triton)", h.nbytes + 16 * count, h.nbytes)
        out = torch.empty_like(h)
        iv0, iv1 = triton_lanes(iv0, iv1)
        _dropout_cuda[grid(triton.cdiv(n, _BLOCK), count)](h, out, seeds, steps, n, iv0, iv1, threshold, scale,
                                                           BLOCK=_BLOCK, FLOAT64=h.dtype == torch.float64,
                                                           BFLOAT16=h.dtype == torch.bfloat16)
        return out
    arguments = (seeds.numpy(), steps.numpy(), iv0, iv1, np.uint32(threshold), np.float32(scale))
    units = count * _chunks(n)  # the kernels' work units, split over torch's threads
    if h.dtype == torch.bfloat16:  # numba has no bfloat16: the kernel reads and writes its bits
        out = torch.empty_like(h)
        bits = [x.view(torch.uint16).view(count, n).numpy() for x in (h, out)]
        fused_kernel("dropout (numba)", h.nbytes + 16 * count, h.nbytes)
        run_split(_dropout_cpu_bfloat16, units, *bits, *arguments, min_part=16)
        return out
    # float16 (numba has none either) is computed in float32 and rounded once, as torch does
    compute = h if h.dtype in (torch.float32, torch.float64) else h.float()
    out = torch.empty_like(compute)
    fused_kernel("dropout (numba)", compute.nbytes + 16 * count, compute.nbytes)
    run_split(_dropout_cpu, units, compute.view(count, n).numpy(), out.view(count, n).numpy(), *arguments,
              min_part=16)
    return out.to(h.dtype)


class _FusedDropout(torch.autograd.Function):
    """``dropout_reference(h, seed, site, step, p)`` by :func:`_dropout_kernel`; the backward recomputes the mask
    from the stream (nothing but ``seed`` and ``step`` is saved) and is itself this function, applied to the
    gradient. Under ``torch.func.vmap`` the rule below runs the kernel once for all trials (a per-trial ``seed``
    and ``step`` become a leading trial dimension), and regular autograd records it, so a vmapped forward is
    differentiated by a plain ``.backward()``."""

    @staticmethod
    def forward(h: Tensor, seed: Tensor, step: Tensor, site: int, p: float) -> Tensor:
        return _dropout_kernel(h, seed, step, site, p)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, seed, step, ctx.site, ctx.p = inputs
        ctx.seed, ctx.step = seed.clone(), step.clone()  # copies: the model increments its step buffer in place

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        return _FusedDropout.apply(grad, ctx.seed, ctx.step, ctx.site, ctx.p), None, None, None, None

    @staticmethod
    def vmap(info, in_dims, h: Tensor, seed: Tensor, step: Tensor, site: int, p: float) -> tuple[Tensor, int]:
        def leading(x: Tensor, dim: int | None) -> Tensor:
            return x.expand(info.batch_size, *x.shape) if dim is None else x.movedim(dim, 0)

        h, seed, step = (leading(x, dim) for x, dim in zip((h, seed, step), in_dims))
        return _FusedDropout.apply(h, seed, step, site, p), 0


def dropout(h: Tensor, seed: Tensor, site: int, step: Tensor, p: float) -> Tensor:
    """Inverted dropout of ``h`` from the stream ``(seed, site, step)``: ``h * keep * dropout_scale(p)``, where
    element ``i`` (flat index within the trial's ``h``) is kept when the 16-bit half ``i & 1`` of
    ``random_bits(seed, site, step, i >> 1)`` is at least ``dropout_threshold(p)`` (probability ``1 - p`` up to
    p's 16-bit quantisation). ``p = 0`` returns ``h`` itself.

    ``seed`` and ``step`` are the trial's int64 0-d tensors (per-trial under ``torch.func.vmap``, where all trials
    run as one kernel); ``h`` may be float32, float64, bfloat16 or float16 (autocast). Differentiable: the backward
    multiplies the gradient by the same mask, recomputed. Bitwise :func:`dropout_reference`.
    """
    dropout_threshold(p)
    if p == 0:
        return h
    if seed.dtype != torch.int64 or step.dtype != torch.int64:
        raise TypeError(f"seed and step must be int64 tensors, got {seed.dtype} and {step.dtype}")
    _initial_lanes(site)
    return _FusedDropout.apply(h, seed, step, site, p)


# ---- a model's streams ---------------------------------------------------------------------------------------------

SITE_BRANCHING = 64  # a stream's child sites: site * 64 + 1 + index, index < 64


@dataclass(frozen=True)
class Stream:
    """A trial's random stream at one training step, at one draw site: what a module draws from in training.

    :class:`mtmoe.mmoe.MMoE` makes one per training forward pass from its ``seed`` and ``step`` buffers and hands
    each part of the model a child of its own (:meth:`child`: the experts, each task gate; a gate's own draws), so
    that two parts never draw the same bits.
    """

    seed: Tensor
    step: Tensor
    site: int = 0

    def child(self, index: int) -> Stream:
        if not 0 <= index < SITE_BRANCHING:
            raise ValueError(f"a stream has {SITE_BRANCHING} children, got index {index}")
        return Stream(self.seed, self.step, self.site * SITE_BRANCHING + 1 + index)

    def uniform(self, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype = torch.float64) -> Tensor:
        return uniform(self.seed, self.site, self.step, tuple(shape), device, dtype)

    def gumbel(self, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype = torch.float64) -> Tensor:
        return gumbel(self.seed, self.site, self.step, tuple(shape), device, dtype)

    def normal(self, shape: tuple[int, ...], device: torch.device | str) -> Tensor:
        """Standard normal float64 noise by the Box-Muller transform of two child streams' uniforms (the first in
        (0, 1]: ``1 - u``)."""
        radius = (-2 * (1 - self.child(0).uniform(shape, device)).log()).sqrt()
        return radius * torch.cos(2 * math.pi * self.child(1).uniform(shape, device))

    def dropout(self, h: Tensor, p: float) -> Tensor:
        return dropout(h, self.seed, self.site, self.step, p)
