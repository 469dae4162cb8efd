"""The quantize pipeline's settings, with their defaults, in one place: the scheme a method writes by default
(:func:`quant_scheme`), the calibration (:class:`CalibConfig`) and the optional tuning (:class:`TuneConfig`).
``qinfer quantize`` passes its options through these, so a library caller gets the same defaults as the command."""

import math
from dataclasses import dataclass, replace

from qinfer.errors import QinferError, check_seed
from qinfer.format import QuantScheme


def quant_scheme(method: str = "gptq", bits: int | None = None, group_size: int | None = None, format: str = "int",
                 symmetric: bool | None = None, act_order: bool | None = None, mse_clip: bool | None = None,
                 kv_cache: str = "none", quantize_lm_head: bool | None = None, lm_head_bits: int | None = None
                 ) -> QuantScheme:
    """The scheme ``qinfer quantize`` writes for these choices; None takes the default for the method and format.

    Integer weights: 4 bits in groups of 128 with a zero point per group (asymmetric: more accurate than symmetric
    at 4 bits for the same storage, see docs/results.md); GPTQ visits columns by decreasing Hessian diagonal
    (act-order, with static groups) and searches each group's clipping (``mse_clip``); RTN and AWQ keep the
    plain min/max (RTN is the baseline; AWQ searches its own clipping). The lm_head (and a tied embedding, read
    from it) is quantized too, to 8-bit integers in the linears' groups (``lm_head_bits``): on a small model it is
    most of a decode step's bytes, and int8 costs little accuracy (docs/results.md, "The lm_head in 8 and 4 bits").
    FP8 (E4M3): one scale per output channel, symmetric, 8 bits, the lm_head too when ``quantize_lm_head`` is set
    (it is not by default); ``method="rtn"`` rounds to nearest (the scheme's method "fp8"), ``"gptq"`` adds error
    feedback.
    """
    fp8 = format == "fp8"
    if fp8 and method == "awq":
        raise QinferError("AWQ produces integer weights: use --format int, or --method gptq|rtn with --format fp8")
    if fp8 and act_order and method != "gptq":  # (named as given: RTN to FP8 is the scheme's method "fp8")
        raise QinferError(f"--act-order applies only to --method gptq, not {method}: drop --act-order")
    if fp8 and method == "rtn":
        method = "fp8"
    return QuantScheme(
        method=method, format=format, kv_cache=kv_cache,
        quantize_lm_head=quantize_lm_head if quantize_lm_head is not None else not fp8,
        bits=bits if bits is not None else 8 if fp8 else 4,
        group_size=group_size if group_size is not None else -1 if fp8 else 128,
        symmetric=symmetric if symmetric is not None else fp8,
        act_order=act_order if act_order is not None else method == "gptq",
        mse_clip=mse_clip if mse_clip is not None else method == "gptq" and not fp8,
        lm_head_bits=lm_head_bits if lm_head_bits is not None else 8,
    )


@dataclass(frozen=True)
class CalibConfig:
    source: str = "austen"
    samples: int = 128
    seq_len: int = 512
    seed: int = 0
    # GPTQ/AWQ: capture each linear group's input after the groups before it are quantized; None: on for GPTQ
    true_sequential: bool | None = None
    fp_target: bool = False  # GPTQ/AWQ: fit each linear to the unquantized model's output (quantizers.gptq.fp_target);
    # implies true_sequential, so that each group's target accounts for the groups before it being quantized
    fp_target_damp: float = 0.3  # ridge of that fit, x mean(diag H): the aim is a regression on the quantized
    # stream's inputs, and weakly excited directions of them otherwise take large, held-out-noisy weights
    # keep what the unquantized model computes at the BOS position (Transformer.set_bos), and calibrate with it
    keep_bos: bool = True

    def resolved(self, method: str) -> "CalibConfig":
        """These settings with the method's defaults filled in (what quantize_report.json records)."""
        if self.true_sequential is not None:
            return self
        return replace(self, true_sequential=method == "gptq" or (method == "awq" and self.fp_target))

    def __post_init__(self):
        if self.samples < 1 or self.seq_len < 2:
            raise QinferError(f"--samples must be >= 1 and --seq-len >= 2 (got {self.samples}, {self.seq_len})")
        if not 0 < self.fp_target_damp < float("inf"):
            raise QinferError(f"--fp-target-damp must be a finite number > 0 (got {self.fp_target_damp}); the "
                              "default is 0.3")
        check_seed(self.seed)
        if not self.source.strip():
            raise QinferError("--calib is empty: name austen (the default), a .txt or .jsonl file, or a dataset")


@dataclass(frozen=True)
class TuneConfig:
    steps: int = 0  # Adam steps per block; 0 = no block tuning
    lr: float = 2e-3  # for the log-scales and the norm weights (both stages)
    batch: int = 4  # calibration samples per block step
    e2e_steps: int = 0  # end-to-end Adam steps of one calibration sample each; 0 = none
    seed: int = 0
    rounding: bool = False  # the block stage also learns each weight's rounding (AutoRound's signed descent)
    holdout: int = 0  # block stage: calibration samples kept out of the steps to pick the best check; 0 = none

    def __post_init__(self):
        if self.steps < 0 or self.e2e_steps < 0 or self.batch < 1 or not 0 < self.lr < math.inf or self.holdout < 0:
            raise QinferError(
                "tuning needs --tune-steps >= 0, --e2e-steps >= 0, --tune-batch >= 1, --tune-holdout >= 0 and a "
                f"finite positive --tune-lr (got {self.steps}, {self.e2e_steps}, {self.batch}, {self.holdout}, "
                f"{self.lr})"
            )
        if self.rounding and not self.steps:
            raise QinferError("--tune-rounding learns the rounding in the block tuning stage: add --tune-steps N (e.g. 200)")
        if self.holdout and not self.steps:
            raise QinferError("--tune-holdout picks the best step of the block tuning stage: add --tune-steps N (e.g. 200)")

    @property
    def active(self) -> bool:
        return self.steps > 0 or self.e2e_steps > 0


def uses_calibration(scheme: QuantScheme, tune: TuneConfig) -> bool:
    """Whether quantizing to ``scheme`` reads calibration text: round to nearest alone (RTN, FP8 RTN) does not."""
    return scheme.method in ("gptq", "awq") or scheme.kv_cache != "none" or tune.active


def recorded_calibration(scheme: QuantScheme, calib: CalibConfig, tune: TuneConfig) -> dict | None:
    """What quantize_report.json records of the calibration: the settings it ran with, None when it read no text."""
    return calib.resolved(scheme.method).__dict__ if uses_calibration(scheme, tune) else None


def check_settings(scheme: QuantScheme, calib: CalibConfig, tune: TuneConfig) -> CalibConfig:
    """Refuse settings that do not go together, before any note or work; returns ``calib`` resolved for the method."""
    if tune.active and scheme.format != "int":
        raise QinferError("--tune-steps/--e2e-steps tune integer group scales; FP8 weights have none (drop them)")
    if tune.holdout and tune.holdout >= calib.samples:
        raise QinferError(f"--tune-holdout {tune.holdout} leaves none of the {calib.samples} calibration samples to tune "
                          "on: hold out fewer, or raise --samples")
    if scheme.mse_clip and scheme.method == "awq":
        raise QinferError("AWQ searches each group's clipping on the block's output itself (on the min/max grid), "
                          "which --mse-clip's shrink would then move off: drop --mse-clip for --method awq")
    if calib.fp_target and calib.true_sequential is False:
        raise QinferError("--fp-target calibrates each linear group after the ones before it: drop --no-true-sequential")
    calib = calib.resolved(scheme.method)
    flags = "--method rtn --format fp8" if scheme.method == "fp8" else f"--method {scheme.method}"  # (FP8 RTN's)
    if calib.true_sequential and scheme.method not in ("gptq", "awq"):
        raise QinferError(
            f"--true-sequential calibrates GPTQ or AWQ group by group inside each block: drop it for {flags}"
        )
    if calib.fp_target and scheme.method not in ("gptq", "awq"):
        raise QinferError(f"--fp-target aims GPTQ or AWQ at the unquantized model: drop it for {flags}")
    return calib
