"""What each NoLoCo method of the simulator puts on the wire: what a partner blends with, and its bytes.

Dense methods (arXiv 2506.10911, eq. 3-5 with the partner's tensors as a wire delivers them):

- ``noloco``: exact fp32 (the maths alone); ``noloco-bf16/int8/int4``: the ``sync`` mode, theta (and phi when the
  run needs it) sent whole in that wire dtype;
- ``noloco-stream[-int8|-int4]``: the ``stream`` mode: phi, fixed during the phase, crosses in bf16 while the
  replicas train; at the outer step only Delta = theta - phi (bf16 or quantized); the receiver rebuilds theta as
  phi + Delta.

Sparse methods (``noloco-sparse-*``, wire/sparse.py; ``noloco-sparse-side`` is the node's ``--wire-dtype sparse``,
``noloco-sparse-phi8`` its earlier form): Delta crosses as the top-k per chunk with 2-bit values, the part left out kept
by its sender and added to the next progress it sends (error feedback). Each side blends its own fast weights whole with
the partner's seen as phi_j + D_j + (Delta_i - D_i) (algorithm.compressed_partner_weights: the pair's sum moves as in
NoLoCo). phi crosses in int8 every K outer steps (``-phiK``); in the other steps a replica takes the partner's phi to be
its own, which drops the pull term gamma * (phi_i - mean(phi)) and nothing else. Two variants spend the bytes of the
other steps differently: ``-sign-phi16`` also sends the residual as it stood at the phase's start, one bit a value (its
sign at its block's mean magnitude: what earlier top-k codes left out reaches the partner one phase late, densely);
``-parity-phi16`` sends in the other steps the lowest bit of phi's int8 codes, decoded against the receiver's own phi
(side information). ``-side`` sends phi at every outer step in the rotated modulo code (wire/side_info.py: 1.6 bits a
value, read against the receiver's own phi, its step set by the gap between the two), so the pull acts at every step; it
drops what its top-k code leaves out instead of feeding it back (the sender has applied it to itself, and its phi
carries it to every later partner), and takes half its own left-out progress as its estimate of the partner's
(``OWN_LEFT_OUT_WEIGHT``). ``-side-c1`` takes all of it (the pair's sum conserved); ``-side-ef`` is ``-side-c1`` with
error feedback, ``-phi1-noef`` ``-side-c1`` with phi in int8. A replica with no partner sends nothing: its residual
waits for the next one.

Late methods (``noloco-late``, ``noloco-late-side``): nothing crosses at the outer step. Each replica steps on its own
progress whole, as if its partner's were the same, and the pair's half of the step comes one phase late: the two
swap the fast weights they held at the last outer step (bf16, or the side-information code), and each adds
beta / 2 of the gap between them to its next step (the eager updates of arXiv 2502.12996, for a pair). What each
costs: docs/algorithm-study.md, "Sparse progress".
"""

from __future__ import annotations

import math

import torch

from noloco_node import algorithm
from noloco_node.wire import quantize, side_info, sparse

# Per dense NoLoCo method: the wire dtype of theta and phi sent whole (sync), or of Delta when phi is streamed.
WIRE_OF_METHOD: dict[str, tuple[str, str | None]] = {
    "noloco": ("fp32", None),
    "noloco-momentum": ("fp32", None),
    "noloco-bf16": ("bf16", None),
    "noloco-int8": ("int8", None),
    "noloco-int4": ("int4", None),
    "noloco-stream": ("bf16", "bf16"),
    "noloco-stream-int8": ("bf16", "int8"),
    "noloco-stream-int4": ("bf16", "int4"),
}

# Per sparse method: how many outer steps apart phi crosses (in int8), None for never.
PHI_EVERY: dict[str, int | None] = {
    "noloco-sparse-phi1": 1,
    "noloco-sparse-phi8": 8,
    "noloco-sparse-phi16": 16,
    "noloco-sparse-sign-phi16": 16,
    "noloco-sparse-parity-phi16": 16,
    "noloco-sparse-side-ef": None,
    "noloco-sparse-side-c1": None,
    "noloco-sparse-side": None,
    "noloco-sparse-phi1-noef": 1,
}
# Sparse methods whose phase payload carries phi at every outer step in the rotated modulo code (wire/side_info.py),
# decoded against the receiver's own phi; small and one-dimensional tensors in int8.
SIDE_PHI = {"noloco-sparse-side-ef", "noloco-sparse-side-c1", "noloco-sparse-side"}
# Sparse methods without error feedback: what a progress's code leaves out is dropped (the sender has applied it to
# itself, and its phi carries it to every later partner).
NO_FEEDBACK = {"noloco-sparse-side-c1", "noloco-sparse-side", "noloco-sparse-phi1-noef"}
# The weight c each side gives its own left-out progress as the estimate of its partner's (algorithm.
# compressed_partner_weights); 1 (the pair's sum conserved) unless listed.
OWN_LEFT_OUT_WEIGHT = {"noloco-sparse-side": algorithm.OWN_LEFT_OUT_WEIGHT}
# Sparse methods whose phase payload carries, in the phases without phi, phi's int8 codes' lowest bit alone (with the
# block scales): the receiver takes the code of that parity nearest its own phi (its own slow weights as side
# information, Wyner-Ziv), which is the int8 code itself while the two slow weights are less than half a step apart.
PARITY_PHI = {"noloco-sparse-parity-phi16"}
# Sparse methods whose phase payload also carries the residual as of the phase's start, one bit a value (its sign,
# at its block's mean magnitude): what earlier top-k codes left out reaches the partner one phase late, densely.
SIGN_RESIDUAL = {"noloco-sparse-sign-phi16"}
SPARSE_PHI_DTYPE = "int8"
SIGN_BLOCK = 256  # values per bf16 scale of the one-bit residual


def sign_view(tensor: torch.Tensor) -> torch.Tensor:
    """What a receiver reads of ``tensor`` sent one bit a value: its sign times its block's mean magnitude."""
    flat = tensor.reshape(-1).to(torch.float32)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % SIGN_BLOCK)).view(-1, SIGN_BLOCK)
    counts = torch.full((padded.shape[0],), float(SIGN_BLOCK))
    counts[-1] = flat.numel() - (padded.shape[0] - 1) * SIGN_BLOCK
    scale = (padded.abs().sum(dim=1) / counts).to(torch.bfloat16).to(torch.float32)
    signs = torch.where(padded >= 0, 1.0, -1.0)
    return (signs * scale.unsqueeze(1)).view(-1)[: flat.numel()].view_as(tensor)


def parity_view(sent: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """What a receiver holding ``own`` reads of ``sent`` sent as the parities of its int8 codes with their scales."""
    flat, mine = sent.reshape(-1).to(torch.float32), own.reshape(-1).to(torch.float32)
    blocks = quantize._padded_blocks(flat)
    scales = blocks.abs().amax(dim=1) / quantize.QMAX["int8"]
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
    parity = torch.remainder(torch.round(blocks / divisor), 2)
    guess = quantize._padded_blocks(mine) / divisor  # the receiver's own phi in the sender's steps
    code = torch.round((guess - parity) / 2) * 2 + parity
    code = torch.where(code > 127, code - 2, torch.where(code < -127, code + 2, code))
    return (code * scales.unsqueeze(1)).view(-1)[: flat.numel()].view_as(sent)


def parity_bytes(numel: int) -> int:
    return math.ceil(numel / 8) + 4 * quantize.num_blocks(numel)


def side_view(
    sent: torch.Tensor, own: torch.Tensor, seed: int, sender_estimate: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(what a receiver holding ``own`` reads of a tensor sent in the side-information code, the RMS gap per chunk
    it measured: None for a tensor sent in int8, which small and one-dimensional tensors are)."""
    if not side_info.side_coded(sent.shape):
        return through_wire([sent], "int8")[0], None
    coded = side_info.encode(sent, sender_estimate, seed)
    return side_info.decode(side_info.unpack(side_info.pack(coded), sent.numel()), own, seed)


def side_bytes(shape: tuple[int, ...]) -> int:
    numel = math.prod(shape)
    return side_info.encoded_bytes(numel) if side_info.side_coded(shape) else quantize.encoded_bytes(numel, "int8")


def sign_bytes(numel: int) -> int:
    return math.ceil(numel / 8) + 2 * math.ceil(numel / SIGN_BLOCK)


def through_wire(tensors: list[torch.Tensor], wire_dtype: str) -> list[torch.Tensor]:
    """What a receiver reads of ``tensors`` sent in ``wire_dtype``: exact in fp32, rounded in bf16, blockwise
    quantized and decoded in int8/int4 (wire/quantize.py, the node's own codec)."""
    if wire_dtype == "fp32":
        return tensors
    if wire_dtype == "bf16":
        return [t.to(torch.bfloat16).to(torch.float32) for t in tensors]
    return [quantize.dequantize(quantize.quantize(t, wire_dtype), t.numel(), wire_dtype).view_as(t) for t in tensors]


def partner_view(
    method: str, theta: list[torch.Tensor], phi: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The (fast, slow) weights a partner blends with, as a dense method's wire delivers them."""
    sync_wire, stream_wire = WIRE_OF_METHOD[method]
    if stream_wire is None:
        return through_wire(list(theta), sync_wire), through_wire(list(phi), sync_wire)
    seen_phi = through_wire(list(phi), "bf16")
    seen_delta = through_wire(algorithm.phase_progress(theta, phi), stream_wire)
    return algorithm.fast_weights_from(seen_phi, seen_delta), seen_phi


def _dense_bytes(numels: list[int], wire_dtype: str) -> float:
    """Bytes of tensors of these sizes in a dense wire dtype."""
    if quantize.is_quantized(wire_dtype):
        return float(sum(quantize.encoded_bytes(n, wire_dtype) for n in numels))
    return float(sum(n * (4 if wire_dtype == "fp32" else 2) for n in numels))


def bytes_per_parameter(
    method: str, shapes: list[tuple[int, ...]], *, sends_phi: bool
) -> tuple[float, float, float] | None:
    """(in all, on the critical path, peak) bytes one replica sends its partner per parameter per outer step, for a
    NoLoCo method on a model of tensors of these shapes; None for methods without pairs. In all is the mean over
    outer steps, the peak the most in any one of them (phi sent once in K outer steps is sent whole that step).
    ``sends_phi``: the sync mode's partner needs phi too (gamma != beta)."""
    numels = [math.prod(shape) for shape in shapes]
    total = float(sum(numels))
    if method in PHI_EVERY:
        every = PHI_EVERY[method]
        progress = sum(sparse.encoded_bytes(n) for n in numels) / total
        residual = sum(sign_bytes(n) for n in numels) / total if method in SIGN_RESIDUAL else 0.0
        per_step = []
        for step in range(every or 1):  # one cycle of outer steps: phi (if ever) at its first
            if method in SIDE_PHI:
                phi = sum(side_bytes(shape) for shape in shapes) / total
            elif every is not None and step == 0:
                phi = _dense_bytes(numels, SPARSE_PHI_DTYPE) / total
            elif method in PARITY_PHI:  # the parities in the other phases
                phi = sum(parity_bytes(n) for n in numels) / total
            else:
                phi = 0.0
            per_step.append(progress + residual + phi)
        return sum(per_step) / len(per_step), progress, max(per_step)
    if method in LATE_WIRE:
        return late_bytes(method, shapes)
    if method not in WIRE_OF_METHOD:
        return None
    sync_wire, stream_wire = WIRE_OF_METHOD[method]
    if stream_wire is None:
        momenta = method == "noloco-momentum"  # theta, phi and delta
        parts = 1 + int(sends_phi or momenta) + int(momenta)
        whole = _dense_bytes(numels, sync_wire) / total * parts
        return whole, whole, whole
    progress = _dense_bytes(numels, stream_wire) / total
    every_step = progress + _dense_bytes(numels, "bf16") / total
    return every_step, progress, every_step


class ErrorFeedback:
    """A replica's residual: the part of its progress that no partner has received yet, added to the next progress it
    sends before that is compressed (error feedback, arXiv 1809.07599; SparseLoCo keeps one per replica).
    :meth:`compress` changes nothing; the caller :meth:`commit`\\ s the residual it returned once a partner has taken
    what was sent."""

    def __init__(self, shapes: list[torch.Size] | list[tuple[int, ...]]) -> None:
        self.residual = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]

    @torch.no_grad()
    def compress(
        self, progress: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(encoded, decoded, residual after sending them) of ``progress`` plus the residual, per tensor."""
        encoded, decoded, residual = [], [], []
        for step, kept_back in zip(progress, self.residual, strict=True):
            total = step.to("cpu", torch.float32) + kept_back
            code = sparse.encode(total)
            sent = sparse.decode(code, total.numel()).view_as(total)
            encoded.append(code)
            decoded.append(sent)
            residual.append(total.sub_(sent))
        return encoded, decoded, residual

    def commit(self, residual: list[torch.Tensor]) -> None:
        self.residual = residual


def sparse_pair_steps(
    groups: list[list[int]],
    thetas: list[list[torch.Tensor]],
    phis: list[list[torch.Tensor]],
    deltas: list[list[torch.Tensor]],
    feedback: list[ErrorFeedback],
    *,
    phi_round: bool,
    sign_residual: bool = False,
    parity_phi: bool = False,
    side_phi_seed: int | None = None,
    gap_estimates: list[dict[int, torch.Tensor]] | None = None,
    error_feedback: bool = True,
    own_left_out_weight: float = 1.0,
    alpha: float,
    beta: float,
    gamma: float,
) -> dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Each replica's (new phi, new delta) for one outer step of a sparse method; the residuals are committed
    here (every replica's step is computed from the state before the round). A replica with no partner sends
    nothing: its residual waits for the next one."""
    sent: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]] = {}
    residuals: dict[int, list[torch.Tensor]] = {}
    for group in groups:
        if len(group) < 2:
            continue
        for i in group:
            progress = algorithm.phase_progress(thetas[i], phis[i])
            early = [sign_view(r) for r in feedback[i].residual] if sign_residual else []
            rest = [p - r for p, r in zip(progress, early, strict=True)] if early else progress
            _, decoded, residuals[i] = feedback[i].compress(rest)
            if early:
                decoded = [d + r for d, r in zip(decoded, early, strict=True)]
            left_out = [d - s for d, s in zip(progress, decoded, strict=True)]
            sent[i] = (decoded, left_out, through_wire(list(phis[i]), SPARSE_PHI_DTYPE) if phi_round else None)
    results = {}
    measured: dict[int, dict[int, torch.Tensor]] = {i: {} for group in groups for i in group}
    for group in groups:
        for i in group:
            partners, partner_phis = [], []
            if len(group) == 2:
                j = next(j for j in group if j != i)
                partner_progress, _, partner_phi = sent[j]
                if partner_phi is not None:
                    seen_phi = partner_phi
                elif side_phi_seed is not None and gap_estimates is not None:
                    seen_phi = []
                    for k, (theirs, mine) in enumerate(zip(phis[j], phis[i], strict=True)):
                        seen, gap = side_view(theirs, mine, side_phi_seed * 4099 + k, gap_estimates[j].get(k))
                        seen_phi.append(seen)
                        if gap is not None:
                            measured[i][k] = gap
                elif parity_phi:
                    seen_phi = [parity_view(theirs, mine) for theirs, mine in zip(phis[j], phis[i], strict=True)]
                else:
                    seen_phi = list(phis[i])
                partners = [
                    algorithm.compressed_partner_weights(seen_phi, partner_progress, sent[i][1], own_left_out_weight)
                ]
                partner_phis = [seen_phi]
            results[i] = algorithm.noloco_outer_step(
                list(thetas[i]), phis[i], deltas[i], partners, partner_phis, alpha=alpha, beta=beta, gamma=gamma
            )
    for i, residual in residuals.items():
        feedback[i].commit(residual if error_feedback else [torch.zeros_like(r) for r in residual])
    for i, gaps in measured.items():  # a replica's estimate of the gap: the last two it measured, averaged
        for k, gap in gaps.items():
            earlier = gap_estimates[i].get(k) if gap_estimates is not None else None
            if gap_estimates is not None:
                gap_estimates[i][k] = gap if earlier is None else (gap + earlier) / 2
    return results


# The late methods: the pair's half of the outer step one phase late (module docstring), with the partner's fast
# weights of the last phase in this wire dtype.
LATE_WIRE = {"noloco-late": "bf16", "noloco-late-side": "side"}


def late_bytes(method: str, shapes: list[tuple[int, ...]]) -> tuple[float, float, float]:
    """(in all, on the critical path, peak) per parameter per outer step of a late method: the same every outer
    step, and nothing waits for a byte."""
    total = float(sum(math.prod(shape) for shape in shapes))
    if LATE_WIRE[method] == "side":
        every_step = sum(side_bytes(shape) for shape in shapes) / total
    else:
        every_step = _dense_bytes([math.prod(shape) for shape in shapes], LATE_WIRE[method]) / total
    return every_step, 0.0, every_step


def late_pair_steps(
    groups: list[list[int]],
    thetas: list[list[torch.Tensor]],
    phis: list[list[torch.Tensor]],
    deltas: list[list[torch.Tensor]],
    previous: list[list[torch.Tensor] | None],
    gap_estimates: list[dict[int, torch.Tensor]],
    *,
    method: str,
    seed: int,
    alpha: float,
    beta: float,
    gamma: float,
) -> dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Each replica's (new phi, new delta) for one outer step of a late method, and ``previous`` set to this
    step's fast weights. Every replica steps on its own progress whole (``beta * Delta_i``, as if its partner's
    were the same), and adds the correction of a pair of the last phase: ``beta / 2 * (theta_j - theta_i)`` of
    the fast weights both held at the last outer step, the partner's as the wire delivers them. Over the two steps
    the replica then moves as NoLoCo's step with that partner (gamma == beta) moves it, the pair's half a phase
    late, and nothing crosses at the outer step itself."""
    if gamma != beta:
        raise ValueError(f"the late methods assume gamma == beta (the partner's fast weights alone): {gamma} != {beta}")
    wire = LATE_WIRE[method]
    corrections: dict[int, list[torch.Tensor]] = {}
    measured: dict[int, dict[int, torch.Tensor]] = {}
    for group in groups:
        if len(group) < 2:
            continue
        i, j = group
        mine_then, theirs_then = previous[i], previous[j]
        if mine_then is None or theirs_then is None:
            continue
        for me, other, own, sent in ((i, j, mine_then, theirs_then), (j, i, theirs_then, mine_then)):
            if wire == "side":
                seen = []
                for k, (theirs, mine) in enumerate(zip(sent, own, strict=True)):
                    view, gap = side_view(theirs, mine, seed * 4099 + k, gap_estimates[other].get(k))
                    seen.append(view)
                    if gap is not None:
                        measured.setdefault(me, {})[k] = gap
            else:
                seen = through_wire(list(sent), wire)
            corrections[me] = [(s - o) * (beta / 2) for s, o in zip(seen, own, strict=True)]
    results = {}
    for i in range(len(thetas)):
        progress = algorithm.phase_progress(thetas[i], phis[i])
        new_delta = [d.to(torch.float32) * alpha + p * beta for d, p in zip(deltas[i], progress, strict=True)]
        if i in corrections:
            new_delta = [d + c for d, c in zip(new_delta, corrections[i], strict=True)]
        results[i] = ([p.to(torch.float32) + d for p, d in zip(phis[i], new_delta, strict=True)], new_delta)
    for i in range(len(thetas)):
        previous[i] = [t.detach().to(torch.float32).clone() for t in thetas[i]]
    for i, gaps in measured.items():
        for k, gap in gaps.items():
            earlier = gap_estimates[i].get(k)
            gap_estimates[i][k] = gap if earlier is None else (gap + earlier) / 2
    return results
