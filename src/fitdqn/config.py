"""The one home of every default.

Each section is a frozen dataclass; each field is declared with :func:`knob`, whose help text is what
``fitdqn ... --help`` shows. TOML in (:func:`load_config`), TOML out (:func:`dump_config`); an unknown key
or a wrong type is a :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from fitdqn.errors import UserError


class ConfigError(UserError):
    """A config key, value or file the user must fix; the message names it and says how."""


INF = math.inf
SEED_MAX = 2**32 - 1  # numpy's and torch's seeds both take it
SYNTHETIC_DATA = "synthetic"  # market.data of the generated market (fitdqn.market.data.synthetic_bars)
WIDTH_MAX = 2**16  # the most a net width, atom or quantile count, or tree fanout may ask for: beyond, a typo
SYNTHETIC_BARS_MAX = 10**8  # synthetic bars generated at most (~5 GB of bars and features): beyond, a typo


@dataclass(frozen=True)
class Bounds:
    """The values a numeric knob admits: ``low``/``high`` (either may be infinite), each closed or open.

    A float knob always needs a finite value (NaN and infinities are refused); for a tuple knob the bounds
    hold for every item.
    """

    low: float = -INF
    high: float = INF
    low_open: bool = False
    high_open: bool = False

    def admits(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        """``in [0, 1)``, ``>= 1``, ``> 0``, or ``a finite number``."""
        if math.isinf(self.low) and math.isinf(self.high):
            return "a finite number"
        if math.isinf(self.high):
            return f"> {self.low:g}" if self.low_open else f">= {self.low:g}"
        if math.isinf(self.low):
            return f"< {self.high:g}" if self.high_open else f"<= {self.high:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


def knob(default: Any, help: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
         lt: float | None = None, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with its one-line help (shown by ``--help`` and written into TOML dumps).

    Numeric knobs declare their bounds here, once: ``ge``/``gt`` (at least / above) and ``le``/``lt`` (at most /
    below); ``ge=-INF, le=INF`` declares "any finite number". String knobs with a fixed set of values declare
    ``choices``. Every value is checked against them (``validate``) before any work; both are optional.
    """
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults: use a tuple")
    metadata: dict[str, Any] = {"help": help}
    if any(v is not None for v in (ge, gt, le, lt)):
        if (ge is not None and gt is not None) or (le is not None and lt is not None):
            raise TypeError("give one lower bound (ge or gt) and one upper bound (le or lt)")
        low, high = (ge if gt is None else gt), (le if lt is None else lt)
        metadata["bounds"] = Bounds(-INF if low is None else low, INF if high is None else high,
                                    low_open=gt is not None, high_open=lt is not None)
    if choices is not None:
        if default not in choices:
            raise TypeError(f"default {default!r} is not one of the choices {choices}")
        metadata["choices"] = tuple(choices)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class NetConfig:
    """Networks: trunk + attention, branching dueling C51 head, IQN head, IQL value net."""

    size: str = knob("small", "network widths: 'small' (widths left at their defaults become config.SMALL_NET's: "
                     "on the synthetic market they generalise better on a GPU too), 'full' (the widths below)",
                     choices=("full", "small"))
    window: int = knob(8, "bars per observation: the attention block attends over this many bar tokens", ge=1)
    trunk_hidden: int = knob(512, "first trunk layer width (state -> trunk_hidden -> d_model)", ge=1, le=WIDTH_MAX)
    d_model: int = knob(256, "trunk output width = attention model width", ge=1, le=WIDTH_MAX)
    attention_heads: int = knob(4, "self-attention heads over the bar tokens", ge=1)
    stream_hidden: int = knob(128, "hidden width of each dueling value/advantage stream", ge=1, le=WIDTH_MAX)
    branches: tuple[int, ...] = knob((5, 5, 5), "sub-actions per branch: target position, stop, take-profit "
                                     "(n, 5, 5); a bracket branch of 1 never places that order", ge=1)
    num_atoms: int = knob(51, "C51 atoms per sub-action", ge=2, le=WIDTH_MAX)
    v_min: float = knob(-10.0, "lowest C51 support value", ge=-INF, le=INF)
    v_max: float = knob(10.0, "highest C51 support value", ge=-INF, le=INF)
    iqn_embedding: int = knob(64, "IQN cosine embedding size", ge=1, le=WIDTH_MAX)
    iqn_quantiles: int = knob(64, "IQN quantile samples in training (N = N')", ge=1, le=WIDTH_MAX)
    iqn_act_quantiles: int = knob(32, "IQN quantile samples for acting (K)", ge=1, le=WIDTH_MAX)
    iql_hidden: int = knob(128, "IQL value net width (state -> h -> h -> 1)", ge=1, le=WIDTH_MAX)


@dataclass(frozen=True)
class LearnConfig:
    """The update: double-DQN n-step targets, C51 + IQN + IQL losses, Adam, target network."""

    gamma: float = knob(0.9, "discount per step", ge=0, le=1)
    n_step: int = knob(1, "n-step return length", ge=1)
    lr: float = knob(1e-3, "Adam learning rate at batch learn.lr_base_batch (scaled for the batch in use by "
                     "learn.lr_scaling, up to learn.lr_max)", gt=0, le=1)
    lr_base_batch: int = knob(0, "the batch at which learn.lr is given; 0 = auto: the tested batch of the device's "
                              "profile (256 on a CPU, 16384 on an H200)", ge=0)
    base_batch: int = knob(256, "the batch at which learn.target_tau and learn.target_period are given", ge=1)
    lr_scaling: str = knob("linear", "learning rate at batch B: 'linear' (lr x B / lr_base_batch: the same "
                           "parameter travel per sample at every batch), 'sqrt' (lr x sqrt(B / lr_base_batch)) or "
                           "'none'; at most learn.lr_max",
                           choices=("sqrt", "linear", "none"))
    lr_max: float = knob(1e-3, "the largest learning rate the scaling rule scales up to (4e-3 at batch 16384 "
                         "diverged on the synthetic market); a learn.lr above it is kept as given", gt=0, le=1)
    lr_decay: str = knob("none", "learning rate over the run's env steps: 'none' (constant), 'cosine' or 'linear' "
                         "(from the batch's rate down to learn.lr_final x it at the end of the run)",
                         choices=("none", "cosine", "linear"))
    lr_final: float = knob(0.1, "the rate at the end of the run, as a fraction of the start's (learn.lr_decay)",
                           ge=0, le=1)
    adam_eps: float = knob(1.5e-4, "Adam epsilon", gt=0)
    weight_decay: float = knob(0.0, "decoupled weight decay (AdamW): each update shrinks the online and IQL "
                               "weights by the learning rate x this; 0 = plain Adam", ge=0, le=INF)
    grad_clip: float = knob(10.0, "global gradient-norm clip", gt=0)
    obs_noise: float = knob(0.3, "standard deviation of Gaussian noise added to the sampled observations (s and "
                            "s', features in z-score units) at each update, fresh every time: a regulariser "
                            "against memorising the training bars (it validated higher on the synthetic market, "
                            "BENCHMARKS.md); 0 = off", ge=0, le=5)
    obs_noise_on: str = knob("all", "the columns of an observation token that learn.obs_noise reaches: 'all' (the "
                             "market features and the agent's state) or 'market' (the market features only)",
                             choices=("all", "market"))
    target_update: str = knob("soft", "target network update: 'soft' (Polyak, every step) or 'hard' (copy)",
                              choices=("soft", "hard"))
    target_tau: float = knob(0.005, "Polyak factor of one soft target update at learn.base_batch (at batch B: "
                             "1 - (1 - tau)^(B / base_batch), the same time constant in samples)", gt=0, le=1)
    target_period: int = knob(1000, "updates at learn.base_batch between hard target copies (the same number "
                              "of samples at any batch)", ge=1)
    kappa: float = knob(1.0, "IQN quantile Huber threshold", gt=0)
    iqn_loss_weight: float = knob(1.0, "weight of the IQN loss in the total loss", ge=0)
    iql_expectile: float = knob(0.7, "IQL expectile tau for V(s)", gt=0, lt=1)
    iql_loss_weight: float = knob(1.0, "weight of the IQL expectile loss in the total loss", ge=0)
    iql_in_target: bool = knob(False, "use V(s') from the IQL net in the TD target instead of Q-target")
    risk: str = knob("neutral", "action selection: 'neutral' (C51 mean), 'cvar' (IQN CVaR) or 'mean_variance' "
                     "(C51 mean - learn.risk_aversion x C51 variance)", choices=("neutral", "cvar", "mean_variance"))
    cvar_alpha: float = knob(0.25, "CVaR level for risk-averse action selection", gt=0, le=1)
    risk_aversion: float = knob(0.1, "learn.risk = mean_variance: the variance's weight (per unit of return)", ge=0)
    epsilon_start: float = knob(1.0, "epsilon-greedy exploration at the start", ge=0, le=1)
    epsilon_end: float = knob(0.05, "epsilon-greedy exploration after decay", ge=0, le=1)
    epsilon_decay_fraction: float = knob(0.5, "share of the run's env steps over which epsilon decays linearly",
                                         gt=0, le=1)
    precision: str = knob("auto", "autocast: 'auto' (bf16 where supported on CUDA), 'bf16' or 'fp32'",
                          choices=("auto", "bf16", "fp32"))


@dataclass(frozen=True)
class ReplayConfig:
    """GPU replay: storage ring, prioritized sampling, HER."""

    capacity: int = knob(2_000_000, "most transitions kept; the plan may give fewer if VRAM is short", ge=1)
    prioritized: bool = knob(True, "prioritized sampling (sum tree); False = uniform")
    alpha: float = knob(0.6, "priority exponent", ge=0, le=1)
    beta_start: float = knob(0.4, "importance-weight exponent at the start, annealed to beta_end", ge=0, le=1)
    beta_end: float = knob(1.0, "importance-weight exponent at the end of training (linear in the run's env steps)",
                           ge=0, le=1)
    priority_eps: float = knob(1e-6, "added to |TD error| so no transition gets zero priority", gt=0)
    her: bool = knob(False, "relabel goals with HER ('future' strategy) and add the goal bonus to the reward; off "
                     "by default: the bonus rewards crossing a goal, not the market's edge (on the synthetic market "
                     "HER on gave a lower validation Sharpe, BENCHMARKS.md)")
    her_k: int = knob(4, "HER future goals per real goal: relabel probability k / (k + 1)", ge=0)
    min_fill: int = knob(10_000, "transitions stored before updates start (at most one epoch's: updates start in "
                         "the first epoch)", ge=0)
    tree_fanout: int = knob(64, "children per node of the prioritized sum tree (wide: a shallow tree, a few "
                            "batched kernels per descent; each descent step reads this many priorities per "
                            "sample)", ge=2, le=WIDTH_MAX)


@dataclass(frozen=True)
class MarketConfig:
    """Market data, contract, splits and the vectorised environment."""

    data: str = knob("sp500", "bars: 'sp500', 'nasdaq', 'synthetic' or a CSV/Parquet path")
    contract: str = knob("auto", "contract spec name ('es', 'nq', ...) or 'auto' from the data")
    date_format: str = knob(
        "auto", "text timestamps: 'auto' (ISO year-first, else day-first or month-first as the values show), "
        "'day-first', 'month-first', or a strptime pattern such as '%d.%m.%Y %H:%M:%S.%f'")
    train_fraction: float = knob(0.7, "first part of the bars for training", gt=0, lt=1)
    validation_fraction: float = knob(0.15, "next part for validation; the rest is the test split", gt=0, lt=1)
    episode_length: int = knob(256, "bars per training episode (random start offsets)", ge=1)
    max_contracts: int = knob(2, "largest absolute position; target positions are -max..+max", ge=1)
    position_sizing: str = knob(
        "volatility", "what a target-position level holds: 'volatility' (the level's contracts x min(1, "
        "market.target_volatility / (ATR(14) / close) of the decision bar): smaller positions when the market is "
        "more volatile than the target, fractional contracts; validates higher on the synthetic market, "
        "BENCHMARKS.md) or 'contracts' (levels -max..+max contracts); rule baselines trade through the same env, "
        "so they are sized the same way", choices=("contracts", "volatility"))
    target_volatility: float = knob(
        0.0, "'volatility' sizing: the ATR(14) / close at and below which a level holds its full contracts; 0 = "
        "derived: the median over the training split", ge=0)
    reward: str = knob("vol", "reward per step: 'pnl' (net P&L in currency) or 'vol' (net P&L / the decision "
                       "bar's ATR(14) of one contract: position x return / trailing volatility - costs), "
                       "times market.reward_scale", choices=("pnl", "vol"))
    reward_scale: float = knob(0.0, "0 = derived from the training split (market.reward_support_sigmas); "
                               "a positive value is used as given", ge=0)
    risk_penalty: float = knob(0.0, "mean-variance reward for training: each step's reward r becomes "
                               "r - risk_penalty x r^2, so the best position grows with the expected return over "
                               "its variance instead of always being the largest; 0 = off (backtests report P&L "
                               "either way)", ge=0)
    reward_support_sigmas: float = knob(
        4.0, "derived reward scale: the C51 support's half-width (net.v_max) holds this many standard deviations "
        "of the full-position discounted return (learn.gamma) on the training split", gt=0)
    synthetic_bars: int = knob(6000, "bars generated for 'synthetic'", ge=2, le=SYNTHETIC_BARS_MAX)
    synthetic_signal: float = knob(0.3, "strength of the planted predictable component in 'synthetic'",
                                   ge=-INF, le=INF)
    seed: int = knob(0, "seed for the synthetic market", ge=0, le=SEED_MAX)


@dataclass(frozen=True)
class CollectConfig:
    """Experience collection on the vectorised environment."""

    num_envs: int = knob(0, "parallel episodes stepped on the device; 0 = auto: 4096 on a GPU, 32 on the CPU", ge=0)
    steps_per_epoch: int = knob(0, "env steps per parallel episode in each epoch; 0 = auto: 16 on a GPU (4096 envs), "
                                "64 on the CPU", ge=0)


@dataclass(frozen=True)
class BudgetConfig:
    """The VRAM budget: every knob that moves memory shows in `fitdqn plan`."""

    batch_size: int = knob(
        -1, "-1: the GPU profile's tested batch; 0: auto (planner computes it); N > 0: exactly N, checked", ge=-1
    )
    replay_buffer_vram_fraction: float = knob(
        0.70, "share of probed free memory for the replay buffer (free memory less CUDA's own: cuBLAS workspaces "
        "and the driver-side bytes of the GPU's profile)", ge=0, lt=1)
    min_batch: int = knob(64, "smallest batch the planner may choose", ge=1)
    max_batch: int = knob(16384, "largest batch the planner may choose", ge=1)
    headroom_fraction: float = knob(0.02, "share of probed free memory kept unused (what no component models: "
                                    "memory other processes take during the run, driver growth)", ge=0, lt=0.5)
    profiles_dir: str = knob("", "extra directory of GPU profile TOML files (yours override shipped ones)")
    trace_cache_dir: str = knob(
        "", "where traces of the training step are cached between plans: '' = $FITDQN_CACHE_DIR, else "
        "$XDG_CACHE_HOME/fitdqn, else ~/.cache/fitdqn; 'off' = trace every time")


@dataclass(frozen=True)
class TrainConfig:
    """The run: epochs, updates, evaluation, checkpoints."""

    device: str = knob("auto", "'auto' (CUDA if present), 'cpu', 'cuda' or 'cuda:N'")
    seed: int = knob(0, "seed for everything", ge=0, le=SEED_MAX)
    epochs: int = knob(20, "epochs of collect + update", ge=1)
    minutes: float = knob(0.0, "stop after this many minutes (0 = no limit)", ge=0)
    sample_reuse: float = knob(8.0, "samples drawn per transition collected: updates = reuse x collected / batch "
                               "(the run's total is exact at any batch)", gt=0)
    min_updates: int = knob(200, "floor of updates: a run whose train.sample_reuse x env steps / batch makes fewer "
                            "draws more samples per transition to make this many (a large batch needs a minimum "
                            "number of steps too); 0 = no floor", ge=0)
    cuda_graphs: bool = knob(True, "capture the update and collector step in CUDA graphs (CUDA only)")
    oom_retries: int = knob(4, "times the OOM guard re-plans an epoch (or retries an evaluation or checkpoint) "
                            "that ran out of device memory before the run stops", ge=0)
    threads: int = knob(
        0, "CPU threads for torch (a run's config.toml records the count used); 0 = auto: OMP_NUM_THREADS if set, "
        "else the usable cores the machine's load leaves idle, at least 1", ge=0)
    eval_every: int = knob(0, "epochs between validation backtests (each one may become the reported network); "
                           "0 = auto: every epoch on a GPU, every 5 on the CPU", ge=0)
    patience: int = knob(0, "early stop: end the run when this many validation backtests in a row have not beaten "
                         "the best validation Sharpe so far (the report is about the best); 0 = off (every epoch runs)",
                         ge=0)
    checkpoint_every: int = knob(5, "epochs between checkpoints", ge=1)
    keep_replay: bool = knob(
        True, "keep the replay buffer in a finished run's checkpoint, so --resume with more --epochs continues it "
        "exactly; false: a much smaller file with the networks, optimizer and counters (evaluate works, training "
        "on does not). Checkpoints during the run always hold the replay"
    )
    eval_seeds: int = knob(3, "seeds for the random-policy baseline in evaluation", ge=0)
    capital: float = knob(
        0.0, "account size for backtest returns, Sharpe, drawdown; 0 = auto: the notional of market.max_contracts "
        "at the split's first price (no leverage at full size)", ge=0
    )
    out: str = knob("", "run directory; empty = runs/<date>-<time>; an existing run is only continued by --resume")
    gpus: int = knob(
        1, "data-parallel processes, one per GPU (on the CPU: gloo processes): N > 1 launches torchrun with N "
        "ranks; under torchrun its world size is used", ge=1)
    dist_timeout: float = knob(
        1800.0, "seconds a rank waits for the others (gradient all-reduce, barriers; rank 0 alone validates, "
        "checkpoints and reports meanwhile) before the job ends with an error", gt=0)
    parallel: int = knob(0, "runs of a study at once: 0 = auto (as many as their plans fit on the GPU; one on a "
                         "CPU); K caps it", ge=0)
    storage: str = knob("", "database URL queueing a study's runs for `fitdqn worker`; empty = this process")


@dataclass(frozen=True)
class EvaluateConfig:
    """Evaluation: batched backtests, rule baselines, bootstrap intervals, walk-forward folds, seeds."""

    segments: int = knob(
        1024, "most contiguous segments of whole episodes a backtest steps in parallel (one network forward per "
        "step for all); 1 = one env bar by bar (the same result, slower)", ge=1)
    folds: int = knob(
        1, "1: train/validation/test by market.*_fraction; K >= 2: walk-forward: the bars after "
        "market.train_fraction are K test blocks, each fold validates on the market.validation_fraction of bars "
        "before its block and trains on everything earlier (one network per fold)", ge=1)
    purge_bars: int = knob(
        -1, "bars left out between a fold's train, validation and test ranges; -1 = auto: 1 % of the bars, at "
        "least learn.n_step", ge=-1)
    seeds: int = knob(1, "training seeds (train.seed, +1, ...), each its own run directory; reported together", ge=1)
    reported_network: str = knob(
        "target", "the network the backtests, best.pt, the report, act and export use: 'target' (the Polyak "
        "average of the trained one, learn.target_tau; validates higher: BENCHMARKS.md 'Which defaults') or "
        "'online' (the one the updates train); collection explores with the online one either way",
        choices=("online", "target"))
    bootstrap_samples: int = knob(2000, "stationary block bootstrap resamples for Sharpe confidence intervals", ge=100)
    block_length: float = knob(0.0, "mean bootstrap block length in bars; 0 = auto: n^(1/3)", ge=0)
    confidence: float = knob(0.95, "confidence level of the intervals", ge=0.5, lt=1)
    bootstrap_seed: int = knob(0, "seed of the bootstrap resampling", ge=0, le=SEED_MAX)
    ma_fast: int = knob(50, "fast moving average of the MA crossover baseline (bars)", ge=1)
    ma_slow: int = knob(200, "slow moving average of the MA crossover baseline (bars)", ge=1)
    momentum_years: float = knob(1.0, "lookback of the time-series momentum baseline, in years of bars",
                                   gt=0)
    tried_configs: int = knob(
        1, "configurations tried to find this one (a tune study's trials: its best.toml sets it); above 1 the "
        "report deflates the agent's Sharpe for them (the deflated Sharpe ratio)", ge=1)
    tried_sharpe_variance: float = knob(
        0.0, "variance of the tried configurations' annualised validation Sharpes (best.toml sets it), how far luck "
        "alone spreads them", ge=0)
    tried_in: str = knob("", "where the tried configurations were tried (best.toml: its tune study), for the report")

    def __post_init__(self) -> None:
        checks = [
            (self.segments >= 1, "evaluate.segments must be at least 1"),
            (self.folds >= 1, "evaluate.folds must be at least 1 (1 = no walk-forward)"),
            (self.purge_bars >= -1, "evaluate.purge_bars must be -1 (auto) or >= 0"),
            (self.seeds >= 1, "evaluate.seeds must be at least 1"),
            (self.bootstrap_samples >= 100, "evaluate.bootstrap_samples must be at least 100"),
            (self.block_length >= 0, "evaluate.block_length must be >= 0 (0 = auto)"),
            (0.5 <= self.confidence < 1.0, "evaluate.confidence must be in [0.5, 1)"),
            (0 < self.ma_fast < self.ma_slow, "evaluate.ma_fast must be positive and below evaluate.ma_slow"),
            (self.momentum_years > 0, "evaluate.momentum_years must be positive"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


@dataclass(frozen=True)
class TuneConfig:
    """Hyperparameter trials (`fitdqn tune`): the Optuna study, its sampler and pruner, trials at once."""

    dir: str = knob("tune", "tune directory: the study database, trials/<number>/ (one run directory per trial), "
                    "best.toml and the report's plots")
    storage: str = knob("", "Optuna storage URL for a study shared by several machines (e.g. "
                        "postgresql://user@host/db); empty = the SQLite file study.db in tune.dir")
    study: str = knob("fitdqn", "study name in the storage")
    trials: int = knob(20, "trials of the study in all: a re-run continues until this many have finished", ge=1)
    parallel: int = knob(0, "trials at once, each its own process: 0 = auto (on a GPU as many as their own plans fit "
                         "in the free memory, a core each; on a CPU one at a time); K caps it (CPU threads split K "
                         "ways); on a GPU each trial is capped at its share (per-process memory fraction)", ge=0)
    objective: str = knob("validation_sharpe", "validation metric of the epoch records maximised (the last "
                          "validated epoch's value; per-epoch values drive pruning)")
    sampler: str = knob("tpe", "Optuna sampler: 'tpe' or 'random'", choices=("tpe", "random"))
    seed: int = knob(0, "sampler seed (a re-run offsets it by the trials already in the study)", ge=0,
                     le=SEED_MAX)
    pruner: str = knob("median", "'median': stop a trial whose validation value is below the median of earlier "
                       "trials at the same epoch; 'none'", choices=("median", "none"))
    startup_trials: int = knob(3, "median pruner: finished trials before any trial is pruned", ge=0)
    warmup_epochs: int = knob(0, "median pruner: epochs of a trial before it may be pruned", ge=0)
    heartbeat_seconds: int = knob(60, "seconds between heartbeats of running trials in the storage; a trial of a "
                                  "tune process silent for twice this is failed and queued again (0 = off)",
                                  ge=0)
    keep_replay: bool = knob(False, "a finished trial's checkpoint keeps its replay buffer (to train the trial on "
                             "with --resume); false: the networks, optimizer and counters that evaluate, act and "
                             "export need (train.keep_replay = false in every trial)")


@dataclass(frozen=True)
class Config:
    """Everything fitdqn reads; `fitdqn <command> --help` lists every field."""

    net: NetConfig = field(default_factory=NetConfig)
    learn: LearnConfig = field(default_factory=LearnConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    market: MarketConfig = field(default_factory=MarketConfig)
    collect: CollectConfig = field(default_factory=CollectConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)


def section_types() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def field_types(section: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section)
    return {f.name: hints[f.name] for f in dataclasses.fields(section)}


def coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check (and lightly convert) one value against its annotation; a mismatch names ``key``."""
    origin = typing.get_origin(annotation)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif annotation is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:
        (item_type, _ellipsis) = typing.get_args(annotation)
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        if isinstance(value, (list, tuple)):
            return tuple(coerce(key, v, item_type) for v in value)
    elif origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            try:
                return coerce(key, value, arg)
            except ConfigError:
                continue
    type_name = getattr(annotation, "__name__", str(annotation))
    raise ConfigError(f"config key '{key}': expected {type_name}, got {value!r} ({type(value).__name__})")


RENAMED_KEYS = {
    "train.replay_ratio": "'train.sample_reuse' (samples drawn per transition collected; the same number: "
    "updates = reuse x collected / batch)",
    "learn.epsilon_decay_steps": "'learn.epsilon_decay_fraction' (the share of the run's env steps over which "
    "epsilon decays, e.g. 0.5)",
}
# keys that are gone, with what replaces them: each gives one error saying so
REMOVED_KEYS = {
    "replay.compile": "the replay's sampling runs the fitdqn:: operators, which pick their kernels by device "
    "(Triton on CUDA); there is nothing to compile",
    "replay.fused_gather": "the replay always gathers a batch with the operator fitdqn::replay_gather (Triton on "
    "CUDA, the torch maths on the CPU)",
    "net.kernels": "the networks and losses call the fitdqn:: operators, which pick their kernels by device "
    "(Triton on CUDA, the plain maths on the CPU; FITDQN_TRITON=0 turns Triton off for debugging)",
    "net.iqn_chunk": "the IQN operator's CPU kernel chunks the quantiles itself; its CUDA kernel keeps no "
    "[B, N, d] tensor",
    "net.iqn_kernel": "the networks and losses call the fitdqn:: operators, which pick their kernels by device",
}


def config_from_dict(data: dict[str, Any], base: Config | None = None) -> Config:
    """Build a Config from nested ``{section: {key: value}}``; unknown sections/keys are errors."""
    base = base or Config()
    sections = section_types()
    updates: dict[str, Any] = {}
    for section_name, values in data.items():
        if section_name not in sections:
            raise ConfigError(
                f"unknown config section '{section_name}'; known sections: {', '.join(sections)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"config section '{section_name}' must be a table of keys, got {values!r}")
        types_ = field_types(sections[section_name])
        changes = {}
        for key, value in values.items():
            full = f"{section_name}.{key}"
            if full in RENAMED_KEYS:
                raise ConfigError(f"config key '{full}' is now {RENAMED_KEYS[full]}")
            if full in REMOVED_KEYS:
                raise ConfigError(f"config key '{full}' was removed: {REMOVED_KEYS[full]}; delete it from the config")
            if key not in types_:
                raise ConfigError(
                    f"unknown config key '{full}'; keys of [{section_name}]: {', '.join(types_)}"
                )
            changes[key] = coerce(full, value, types_[key])
        updates[section_name] = dataclasses.replace(getattr(base, section_name), **changes)
    config = dataclasses.replace(base, **updates)
    validate(config)
    return config


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' not found")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file '{path}' is not valid TOML: {error}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"config file '{path}' is not text (byte {error.start:,} is "
                          f"0x{error.object[error.start]:02x}): give a TOML file") from None
    except OSError as error:
        raise ConfigError(f"config file '{path}' cannot be read: {error.strerror or error}") from None


def load_config(path: str | Path, base: Config | None = None) -> Config:
    return config_from_dict(read_toml(path), base)


# keys a run directory's config.toml may predate, with the value every run had before the key existed (a run is
# read back as it was trained, not with a later default)
PREDATED_KEYS = {
    "market.position_sizing": "contracts",  # before volatility sizing, levels were whole contracts
}


def load_run_config(path: str | Path) -> Config:
    """The config a run wrote (``config.toml`` of a run directory): :func:`load_config`, where a key the file
    predates (:data:`PREDATED_KEYS`) takes the value runs had then, and a key removed since (:data:`REMOVED_KEYS`:
    none changed what a run computes) is dropped."""
    try:
        data = read_toml(path)
        for key in REMOVED_KEYS:
            section, name = key.split(".")
            if isinstance(data.get(section), dict):
                data[section].pop(name, None)
        for key, value in PREDATED_KEYS.items():
            section, name = key.split(".")
            if isinstance(data.get(section, {}), dict):  # a malformed section: config_from_dict names it
                data.setdefault(section, {}).setdefault(name, value)
        return config_from_dict(data)
    except ConfigError as error:
        where = "" if str(path) in str(error) else f"'{path}': "
        raise ConfigError(f"{where}{error} (the config a run wrote and reads back: fix what it names, or restore the "
                          "file; fitdqn writes every key of the run into it)") from None


def config_to_dict(config: Config) -> dict[str, dict[str, Any]]:
    return {
        name: {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(section).items()}
        for name, section in ((f.name, getattr(config, f.name)) for f in dataclasses.fields(config))
    }


def dump_config(config: Config) -> str:
    return tomli_w.dumps(config_to_dict(config))


def with_overrides(config: Config, overrides: dict[str, Any]) -> Config:
    """Apply dotted overrides ``{"learn.lr": 3e-4}``."""
    nested: dict[str, dict[str, Any]] = {}
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        nested.setdefault(section, {})[key] = value
    return config_from_dict(nested, config)


# collect.num_envs = 0: enough envs to keep a GPU busy; on the CPU a run of the default length (20 epochs x 64
# steps x 32 envs, train.sample_reuse 8: 1,280 updates at batch 256) that trains the small nets in minutes
AUTO_NUM_ENVS = {"cuda": 4096, "cpu": 32}
# collect.steps_per_epoch = 0: on a GPU 20 x 16 x 4096 = 1.3 M env steps (10.5 M samples, 640 updates at batch
# 16384); more passes over the 4,200 training bars of the synthetic market made the validation Sharpe fall
AUTO_STEPS_PER_EPOCH = {"cuda": 16, "cpu": 64}
# train.eval_every = 0: on the H200 the default run's validation Sharpe peaks and falls between the every-5-epoch
# backtests; validating every epoch (a CUDA-graph replay there: a few ms) lets validation choose from all 20
# (3 seeds, measured at 4d9ef94: median validation Sharpe of the chosen network 3.46 against 3.09); on the CPU an
# eager backtest of the validation split takes about 0.5 s
AUTO_EVAL_EVERY = {"cuda": 1, "cpu": 5}
# net.size = 'small': the widths of a net that a 2-core CPU trains at ~10 updates/s at batch 256 (the full
# widths: ~1 update/s, too slow to learn in minutes); on the H200 (batch 16384, 3 seeds) they also beat the full
# widths on validation (median Sharpe 3.69 vs 3.46): the full ones overfit the 4,200 training bars (BENCHMARKS.md)
SMALL_NET = {"trunk_hidden": 128, "d_model": 64, "stream_hidden": 64, "iqn_embedding": 32, "iqn_quantiles": 16,
             "iqn_act_quantiles": 16, "iql_hidden": 64}


@dataclass(frozen=True)
class ProfileBatch:
    """``budget.batch_size = -1``: the GPU profile's tested batch, checked against the memory."""


@dataclass(frozen=True)
class AutoBatch:
    """``budget.batch_size = 0``: the planner computes it from what the fixed consumers leave."""


@dataclass(frozen=True)
class FixedBatch:
    """``budget.batch_size = N > 0``: exactly N, checked against the memory."""

    size: int


BatchChoice = ProfileBatch | AutoBatch | FixedBatch


def batch_choice(budget: BudgetConfig) -> BatchChoice:
    """The one reading of ``budget.batch_size`` (-1 / 0 / N, its knob's encoding)."""
    if budget.batch_size > 0:
        return FixedBatch(budget.batch_size)
    return ProfileBatch() if budget.batch_size == -1 else AutoBatch()



def for_device(config: Config, device_kind: str) -> Config:
    """Resolve the 'auto' values that depend on the device kind ('cuda' or 'cpu'); idempotent."""
    if config.collect.num_envs == 0:
        collect = dataclasses.replace(config.collect, num_envs=AUTO_NUM_ENVS[device_kind])
        config = dataclasses.replace(config, collect=collect)
    if config.collect.steps_per_epoch == 0:
        collect = dataclasses.replace(config.collect, steps_per_epoch=AUTO_STEPS_PER_EPOCH[device_kind])
        config = dataclasses.replace(config, collect=collect)
    if config.train.eval_every == 0:
        config = dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                      eval_every=AUTO_EVAL_EVERY[device_kind]))
    net = config.net
    if net.size == "small":  # widths the user left at their defaults become the small ones
        defaults = NetConfig()
        net = dataclasses.replace(net, **{k: v for k, v in SMALL_NET.items()
                                          if getattr(net, k) == getattr(defaults, k)})
    return dataclasses.replace(config, net=net)


def knob_choices(section: type, name: str) -> tuple[str, ...]:
    """The values a string knob declares (``knob_choices(MarketConfig, "reward")``): code that branches on a knob
    reads them here instead of restating them."""
    spec = next((f for f in dataclasses.fields(section) if f.name == name), None)
    if spec is None or "choices" not in spec.metadata:
        raise TypeError(f"{section.__name__}.{name} is not a knob with declared choices")
    return spec.metadata["choices"]


def knob_error(key: str, value: Any, spec: dataclasses.Field) -> str | None:
    """Why ``value`` is refused for the knob ``key`` (its declared bounds or choices), or None if it is fine."""
    bounds: Bounds | None = spec.metadata.get("bounds")
    choices: tuple[str, ...] | None = spec.metadata.get("choices")
    help_text = spec.metadata.get("help", "")
    if choices is not None and value not in choices:
        listed = ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}" if len(choices) > 1 else repr(choices[0])
        return f"{key} must be {listed}, got {value!r}"
    items = value if isinstance(value, tuple) else (value,)
    numbers = [v for v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]
    what = f"every value of {key}" if isinstance(value, tuple) else key
    if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
        return f"{what} must be a finite number, got {value!r} ({help_text})"
    if bounds is not None and not all(bounds.admits(v) for v in numbers):
        return f"{what} must be {bounds.describe()}, got {value!r} ({help_text})"
    return None


def check_knobs(config: Config) -> None:
    """Every knob against its declared bounds and choices; the first refused value is a ConfigError."""
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for spec in dataclasses.fields(values):
            message = knob_error(f"{section.name}.{spec.name}", getattr(values, spec.name), spec)
            if message:
                raise ConfigError(message)


def validate(config: Config) -> None:
    """Each knob against its bounds (declared once, in its ``knob``), then the checks across fields."""
    check_knobs(config)
    b, m, n = config.budget, config.market, config.net
    checks = [
        (b.min_batch <= b.max_batch, "budget.min_batch must be <= budget.max_batch"),
        (m.train_fraction + m.validation_fraction < 1.0,
         "market.train_fraction + market.validation_fraction must be < 1 (the rest is the test split)"),
        (n.d_model % n.attention_heads == 0, "net.d_model must be divisible by net.attention_heads"),
        (n.v_min < n.v_max, "net.v_min must be below net.v_max"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
