"""How often to checkpoint: the intervals that maximise goodput, from what a save blocks, what a
relaunch costs and how often the job fails (docs/cadence.md). Arithmetic only: no JAX, no I/O, so
the forecast (tools/goodput_forecast.py) and the run (runner.train.checkpointing) share it.

The model (Young 1974; Daly 2006; two levels as in Moody et al. 2010, SCR):

- Failures stop the job as a Poisson process in wall time with mean M seconds between them (the
  job's MTBF: the per-host MTBF over the number of hosts, since any host's failure stops a
  synchronous job).
- The loop trains tau seconds, then a save blocks it C seconds (C_D for the durable tier in run.dir,
  C_L for the local tier). A failure before a save has returned loses that save.
- With two tiers the durable save replaces every k-th local save (tau_D = k tau_L). A fraction p of
  failures leaves the local tier usable (a killed process, a crash: the host and its disk survive,
  or a lost host's shards have a copy on another host); the rest restart from the durable tier.
- A failure costs the wall time since the newest checkpoint that survives it, plus the relaunch R
  (start, restore, compile) before training resumes; a failure during a relaunch starts it again,
  from the same tier (which tier survived is decided once, by the failure during training).

Under these assumptions `expected_goodput` is exact (a renewal argument over one durable period,
below), `simulate` draws the same process with seeded failures, and `best` maximises the former.
Young's sqrt(2 C M) and Daly's higher-order optimum are the single-tier special cases. Costs of
more than MAX_OVER_MTBF job MTBFs are refused (Unworkable): the goodput there is below e^-50,
nothing to plan with, and exp() overflows a float past ~709 MTBFs (a simulated relaunch would
take ~e^(R/M) tries).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional, Sequence

from runner.errors import ConfigError

HOUR = 3600.0
DAY = 86400.0

# The defaults' published source: Llama 3 405B (Meta, "The Llama 3 Herd of Models", 2024, section 3.3.4)
# trained 54 days on 16,384 H100s (2,048 hosts of 8) with 419 unexpected interruptions, about 78% of them
# confirmed or suspected hardware (a GPU, its memory, a host component): a host whose local disk or RAM is lost.
LLAMA3_HOSTS, LLAMA3_DAYS, LLAMA3_INTERRUPTIONS = 2048, 54, 419
LLAMA3_MTBF_HOURS_PER_HOST = LLAMA3_DAYS * 24 * LLAMA3_HOSTS / LLAMA3_INTERRUPTIONS  # 6,335 hours
DEFAULT_MTBF_HOURS = 6300.0  # checkpoint.mtbf_hours: the figure above, rounded
DEFAULT_HOST_LOSS = 0.78  # checkpoint.local.host_loss_fraction: Llama 3's hardware share
MAX_OVER_MTBF = 50.0  # a relaunch, save or segment longer than this many job MTBFs: refused (goodput < e^-50)
MAX_SIMULATED_FAILURES = 100_000  # expected failures of one simulated run beyond which `simulate` refuses


def job_mtbf_s(mtbf_hours_per_host: float, hosts: int) -> float:
    """The job's mean seconds between failures: any of its hosts failing stops it."""
    return mtbf_hours_per_host * HOUR / max(1, hosts)


def young(save_s: float, mtbf_s: float) -> float:
    """Young's (1974) first-order optimum interval: sqrt(2 C M)."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly(save_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimum, for exponential failures: sqrt(2CM) [1 + sqrt(C/2M)/3 +
    (C/2M)/9] - C while C < 2M, else M. It does not depend on the relaunch cost."""
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    r = save_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - save_s


def first_order_goodput(tau: float, save_s: float, relaunch_s: float, mtbf_s: float) -> float:
    """Young's first-order estimate: 1 - C/tau - (tau/2 + R)/M (good while tau, C, R << M)."""
    return 1.0 - save_s / tau - (tau / 2.0 + relaunch_s) / mtbf_s


@dataclass(frozen=True)
class Costs:
    """What the choice is made from, in seconds: the durable save's blocking time C_D, the
    relaunch R, the job's MTBF M; with a local tier its save's C_L and the fraction p of failures
    it recovers from."""

    save_s: float
    relaunch_s: float
    mtbf_s: float
    local_save_s: Optional[float] = None  # None: no local tier
    local_recovers: float = 0.0

    @property
    def failures_per_day(self) -> float:
        return DAY / self.mtbf_s


@dataclass(frozen=True)
class Cadence:
    """Seconds of training between durable saves, and between local saves (None: no local saves).
    The durable save takes the place of every k-th local one: k = round(durable_s / local_s)."""

    durable_s: float
    local_s: Optional[float] = None

    @property
    def k(self) -> int:
        return 1 if not self.local_s else max(1, round(self.durable_s / self.local_s))

    @property
    def period_s(self) -> float:
        """The training seconds of one local interval (the durable one when there are no local saves)."""
        return self.local_s if self.local_s and self.k > 1 else self.durable_s

    def scaled(self, factor: float) -> "Cadence":
        return Cadence(self.durable_s * factor, None if self.local_s is None else self.local_s * factor)


class Unworkable(ValueError):
    """Costs beyond the model's range: `what` takes `seconds`, `ratio` job MTBFs. The goodput there
    is ~0, nothing to plan with, and the arithmetic would overflow (or a simulation never end)."""

    def __init__(self, what: str, seconds: float, mtbf_s: float, why: str = "") -> None:
        self.what, self.seconds, self.ratio = what, seconds, seconds / mtbf_s
        super().__init__(why or (
            f"a {what} of {seconds:.3g} s is {self.ratio:.3g} times the job's MTBF ({_duration(mtbf_s)}); beyond "
            f"{MAX_OVER_MTBF:g} the expected goodput is below e^-{MAX_OVER_MTBF:g}, nothing to plan with, and the "
            "model's exponentials overflow."))


def check_range(costs: Costs, *segments_s: float, start_s: float = 0.0) -> None:
    """Refuse (Unworkable) a relaunch, a save, a first start or a segment (an interval and its save)
    longer than MAX_OVER_MTBF job MTBFs, before any exponential of it is taken."""
    named = [("relaunch", costs.relaunch_s), ("save", costs.save_s), ("local save", costs.local_save_s or 0.0),
             ("first start", start_s), *(("segment (an interval and its save)", x) for x in segments_s)]
    for what, seconds in named:
        if seconds > MAX_OVER_MTBF * costs.mtbf_s:
            raise Unworkable(what, seconds, costs.mtbf_s)


def _segment(x: float, p: float, lam: float, relaunch_wall: float) -> tuple[float, float, float]:
    """(alpha, log beta, gamma) of E_j = alpha + beta E_{j+1} + gamma E_0 for a segment of x wall
    seconds (training then a save): it ends without a failure with probability e^(-x/M); a failure
    after min(T, x) costs the relaunch, then restarts this segment (p) or the durable period (1 - p).
    beta + gamma = 1; beta is kept as its logarithm, e^(-x/M) without 1 - q's cancellation (which
    loses every digit by x = 37 M)."""
    q = -math.expm1(-lam * x)  # a failure within the segment
    spent = x if lam == 0 else q / lam  # E[min(T, x)]
    scale = (1.0 - p) + p * math.exp(-lam * x)  # 1 - q p, without its cancellation when q p is near 1
    if scale <= 0.0:  # a failure is certain and always restarts this segment: it never ends
        return math.inf, 0.0, 0.0
    log_scale = math.log1p(-q * p) if q * p < 0.5 else math.log(scale)  # (each exact where the other is not)
    return (spent + q * relaunch_wall) / scale, -lam * x - log_scale, q * (1.0 - p) / scale


def period_wall_s(cadence: Cadence, costs: Costs) -> float:
    """The expected wall seconds to complete one durable period (k local intervals, the last ending
    in the durable save), failures, lost work and relaunches included. Renewal argument: with E_j
    the expected time from the checkpoint before segment j to the period's end, E_j = alpha_j +
    beta_j E_{j+1} + gamma_j E_0 and E_k = 0, which solves in closed form for E_0: since beta +
    gamma = 1, the chance a pass through the period is not sent back is beta^(k-1) beta_D."""
    k, tau = cadence.k, cadence.period_s
    local_s = costs.local_save_s if costs.local_save_s is not None else costs.save_s
    check_range(costs, tau + local_s, tau + costs.save_s)
    lam = 1.0 / costs.mtbf_s
    relaunch_wall = costs.relaunch_s if lam == 0 else math.expm1(lam * costs.relaunch_s) / lam
    p = costs.local_recovers if k > 1 else 0.0
    a, log_b, g = _segment(tau + local_s, p, lam, relaunch_wall)
    a_d, log_b_d, _ = _segment(tau + costs.save_s, p, lam, relaunch_wall)
    log_last = (k - 1) * log_b
    completes = log_last + log_b_d  # (its logarithm)
    if math.isinf(a) or math.isinf(a_d) or completes < -700.0:  # (a period that almost never ends)
        return math.inf
    geometric = (k - 1) if g == 0.0 else -math.expm1(log_last) / g  # sum of beta^i, i < k - 1 (1 - beta = gamma)
    return (geometric * a + math.exp(log_last) * a_d) * math.exp(-completes)


def expected_goodput(cadence: Cadence, costs: Costs) -> float:
    """The long-run fraction of wall time that is training kept (exact under the model)."""
    return cadence.k * cadence.period_s / period_wall_s(cadence, costs)


def expected_run_goodput(cadence: Cadence, costs: Costs, work_s: float, start_s: float = 0.0) -> float:
    """The same for a run of `work_s` training seconds whose first launch costs `start_s` before it
    trains (a finite run pays its first start once: what a short measured run shows)."""
    check_range(costs, start_s=start_s)
    lam = 1.0 / costs.mtbf_s
    start = math.expm1(lam * start_s) / lam if start_s else 0.0
    goodput = expected_goodput(cadence, costs)
    return 0.0 if goodput <= 0.0 else work_s / (start + work_s / goodput)


def _golden_max(f: Callable[[float], float], lo: float, hi: float, iterations: int = 60) -> float:
    """The x in [lo, hi] (lo > 0) that maximises a unimodal f, searched on a log scale."""
    a, b = math.log(lo), math.log(hi)
    if b - a < 1e-9:
        return lo
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(math.exp(c)), f(math.exp(d))
    for _ in range(iterations):
        if fc >= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(math.exp(d))
    return math.exp((a + b) / 2.0)


def _k_candidates(most: int) -> list[int]:
    small = list(range(1, min(most, 32) + 1))
    big = sorted({int(round(32 * 1.15 ** i)) for i in range(1, 80) if 32 * 1.15 ** i <= most})
    return small + big


def best(costs: Costs, min_s: float = 1e-3, max_s: float = math.inf) -> Cadence:
    """The cadence of highest expected goodput with every interval in [min_s, max_s] (min_s: one
    step; max_s: checkpoint.auto_max_minutes). One tier: the exact model's optimum, near Daly's.
    Two tiers: the best local interval for each k, and the best k (k = 1: no local saves, when the
    local tier costs as much as the durable one or recovers from nothing). Unworkable when even the
    shortest interval, or the relaunch, is out of the model's range."""
    save = max(costs.save_s, costs.local_save_s or 0.0)
    check_range(costs, min_s + save)
    # no interval whose segment (it and its save) reaches MAX_OVER_MTBF job MTBFs: a period almost never ends
    hi = max(min_s, min(max_s, (MAX_OVER_MTBF * costs.mtbf_s - save) * (1.0 - 1e-9)))
    if costs.local_save_s is None:
        return Cadence(_golden_max(lambda t: expected_goodput(Cadence(t), costs), min_s, hi))
    found: list[tuple[float, Cadence]] = []
    for k in _k_candidates(max(1, int(hi / min_s))):
        tau = _golden_max(lambda t: expected_goodput(Cadence(k * t, t), costs), min_s, max(min_s, hi / k), 40)
        found.append((expected_goodput(Cadence(k * tau, tau), costs), Cadence(k * tau, tau)))
    chosen = max(found, key=lambda item: item[0])[1]
    return Cadence(chosen.durable_s) if chosen.k == 1 else chosen


# ----------------------------------------------------------------------------- the simulation


@dataclass(frozen=True)
class Simulated:
    """Seeded runs of the model: their goodput (all the work over all the wall time), its standard
    error, one run's spread (the noise of a single measured run), and the mean failures per run."""

    goodput: float
    stderr: float
    stdev: float
    failures: float
    runs: int


def simulate(cadence: Cadence, costs: Costs, work_s: float, runs: int = 100, seed: int = 0, start_s: float = 0.0,
             final_save: bool = False, failure_times: Optional[Sequence[float]] = None) -> Simulated:
    """Runs of `work_s` training seconds, each with its own seeded failures (exponential gaps of
    mean M; or, with `failure_times`, those wall times, the same for every run): a first start of
    `start_s`; training that saves every local interval (the durable save every k-th), each save
    blocking its tier's cost; a failure that returns the run to the newest checkpoint that survives
    it (the local tier's with probability p, else the durable tier's, the local ones lost) and pays
    the relaunch, itself restarted from the same tier by a failure during it (as the closed form).
    `final_save`: the run ends with a durable save (as runner's final save). Unworkable when the
    costs are out of range or, without `failure_times`, a run would meet more than
    MAX_SIMULATED_FAILURES failures on average (it would not end in any useful time)."""
    if failure_times is None:
        goodput = expected_run_goodput(cadence, costs, work_s, start_s)
        expected = math.inf if goodput <= 0.0 else work_s / goodput / costs.mtbf_s
        if expected > MAX_SIMULATED_FAILURES:
            raise Unworkable("simulated run", work_s, costs.mtbf_s, why=(
                f"a simulated run would meet about {expected:.3g} failures (more than {MAX_SIMULATED_FAILURES:,}): "
                f"its expected goodput is {goodput:.3g}, too little to simulate."))
    walls, failures = [], []
    for run in range(runs):
        rng = random.Random(seed * 1_000_003 + run)
        wall, count = _one_run(cadence, costs, work_s, rng, start_s, final_save, failure_times)
        walls.append(wall)
        failures.append(count)
    goodput = runs * work_s / sum(walls)  # the work over the expected wall, as the closed form (not E[work/wall])
    each = [work_s / w for w in walls]
    mean = sum(each) / runs
    stdev = math.sqrt(sum((g - mean) ** 2 for g in each) / (runs - 1)) if runs > 1 else 0.0
    return Simulated(goodput, stdev / math.sqrt(runs), stdev, sum(failures) / runs, runs)


def _failures(rng: random.Random, mtbf_s: float, given: Optional[Sequence[float]]) -> Iterator[float]:
    if given is not None:
        yield from given
        yield math.inf
        return
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        yield t


def _one_run(cadence: Cadence, costs: Costs, work_s: float, rng: random.Random, start_s: float, final_save: bool,
             failure_times: Optional[Sequence[float]]) -> tuple[float, int]:
    """(wall seconds, failures) of one run; positions are in training seconds, saves at multiples
    of the local interval."""
    tau, k = cadence.period_s, cadence.k
    p = costs.local_recovers if k > 1 else 0.0
    local_cost = costs.local_save_s if costs.local_save_s is not None else costs.save_s
    upcoming = _failures(rng, costs.mtbf_s, failure_times)
    next_failure = next(upcoming)
    wall, count = 0.0, 0
    index = durable = 0  # the surviving state's save index (its position is index * tau), and the durable one's
    last = math.ceil(work_s / tau - 1e-9)

    def relaunch(cost: float) -> None:  # a failure during it restarts it, from the same tier
        nonlocal wall, next_failure, count
        while next_failure < wall + cost:
            wall, next_failure, count = next_failure, next(upcoming), count + 1
        wall += cost

    relaunch(start_s)
    while index < last:
        j = index + 1
        train = min(tau, work_s - index * tau)
        is_durable = j % k == 0 or j == last
        save = (costs.save_s if is_durable else local_cost) if (j < last or final_save) else 0.0
        if next_failure >= wall + train + save:
            wall += train + save
            index = j
            durable = j if is_durable else durable
            continue
        wall, next_failure, count = next_failure, next(upcoming), count + 1
        if rng.random() >= p:  # the local tier does not survive it: back to the durable save
            index = durable
        relaunch(costs.relaunch_s)
    return wall, count


# ----------------------------------------------------------------------------- checkpoint.cadence=auto


@dataclass(frozen=True)
class Measured:
    """What one process measured (runner.train.checkpointing shares process 0's, so that every
    process decides alike): seconds a durable and a local save block, each over how many saves
    (None: none yet), a relaunch's seconds (start, restore, compile) over how many launches, and a
    step's seconds (None: not known yet)."""

    save_s: Optional[float]
    saves: int
    local_save_s: Optional[float]
    local_saves: int
    relaunch_s: float
    launches: int
    step_s: Optional[float]

    @classmethod
    def of(cls, totals: Mapping[str, float], saves: Mapping[str, int], launches: int,
           step_s: Optional[float], relaunches: Sequence[float] = ()) -> "Measured":
        """From goodput's totals over all launches (runner.observability.goodput) and its save counts.
        The relaunch is the mean of `relaunches` (each launch's start, restore and compile seconds, from
        launches.jsonl) when given; else the totals' over `launches`, which counts only the launches a
        checkpoint remembers, so it is biased low when launches die before their first save."""
        durable, local = int(saves.get("checkpoint", 0)), int(saves.get("checkpoint_local", 0))
        if relaunches:
            relaunch, launches = sum(relaunches) / len(relaunches), len(relaunches)
        else:
            relaunch = sum(totals.get(c, 0.0) for c in ("startup", "restore", "compile")) / max(1, launches)
        return cls(totals.get("checkpoint", 0.0) / durable if durable else None, durable,
                   totals.get("checkpoint_local", 0.0) / local if local else None, local, relaunch, launches, step_s)


@dataclass(frozen=True)
class Choice:
    """auto's intervals in steps (local 0: no local saves), what they are in seconds, the costs they
    were chosen from and the goodput they are expected to give."""

    every_steps: int
    local_every_steps: int
    cadence: Cadence
    costs: Costs
    goodput: float


class AutoCadence:
    """checkpoint.cadence=auto: chooses both tiers' intervals in steps from what was measured, and
    says so at launch and whenever a choice moves an interval by more than `CHANGE` (a save's
    measured cost wanders; the intervals should not)."""

    CHANGE = 0.2

    def __init__(self, mtbf_hours: float, hosts: int, max_s: float, fixed: str, local: bool = False,
                 local_recovers: float = 0.0) -> None:
        self.mtbf_hours, self.hosts, self.max_s, self.fixed = mtbf_hours, hosts, max_s, fixed
        self.local, self.local_recovers = local, local_recovers
        self.current: Optional[Choice] = None
        self.said_waiting = False

    @property
    def mtbf_s(self) -> float:
        return job_mtbf_s(self.mtbf_hours, self.hosts)

    def costs(self, m: Measured) -> Optional[Costs]:
        """The model's costs, or None while a tier's save (or the step time) is still unmeasured."""
        if m.save_s is None or m.step_s is None or (self.local and m.local_save_s is None):
            return None
        return Costs(m.save_s, m.relaunch_s, self.mtbf_s, m.local_save_s if self.local else None,
                     self.local_recovers if self.local else 0.0)

    def choose(self, m: Measured) -> Optional[Choice]:
        costs = self.costs(m)
        if costs is None:
            return None
        assert m.step_s is not None
        try:
            found = best(costs, min_s=m.step_s, max_s=max(m.step_s, self.max_s))
        except Unworkable as err:  # the run's setting, not the arithmetic: one paragraph, exit 2
            raise ConfigError("checkpoint.mtbf_hours", self.mtbf_hours, f"over {_plural(self.hosts, 'host')} it "
                              f"makes the job's MTBF {_duration(self.mtbf_s)}, and measured, {err}",
                              "raise checkpoint.mtbf_hours (it is per host), or use checkpoint.cadence=fixed."
                              ) from None
        local = 0 if found.local_s is None else max(1, round(found.local_s / m.step_s))
        durable = local * found.k if local else max(1, round(found.durable_s / m.step_s))
        cadence = Cadence(durable * m.step_s, local * m.step_s if local else None)
        return Choice(durable, local, cadence, costs, expected_goodput(cadence, costs))

    def update(self, m: Measured) -> tuple[Optional[Choice], Optional[str]]:
        """(the choice to apply, the line to print): a first choice, or one that moved an interval by
        more than CHANGE; before any choice, the line saying why (once)."""
        choice = self.choose(m)
        if choice is None:
            if self.current is not None or self.said_waiting:
                return None, None
            self.said_waiting = True
            return None, self.waiting(m)
        if self.current is not None and not self._moved(self.current, choice):
            return None, None
        self.current = choice
        return choice, self.line(choice, m)

    def _moved(self, old: Choice, new: Choice) -> bool:
        def far(a: int, b: int) -> bool:
            return (a == 0) != (b == 0) or (a and abs(b - a) / a > self.CHANGE)
        return bool(far(old.every_steps, new.every_steps) or far(old.local_every_steps, new.local_every_steps))

    def _failures(self) -> str:
        per_day = DAY / self.mtbf_s
        return (f"job MTBF {_duration(self.mtbf_s)} (checkpoint.mtbf_hours={self.mtbf_hours:g} per host over "
                f"{self.hosts} host{'s' if self.hosts != 1 else ''}: {_count(per_day)} interruptions a day)")

    def waiting(self, m: Measured) -> str:
        missing = [what for what, value in (("a durable save", m.save_s), ("a step", m.step_s)) if value is None]
        missing += ["a local save"] if self.local and m.local_save_s is None else []
        return (f"checkpoint cadence auto: {self.fixed} (the fixed intervals) until {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} measured; relaunch {m.relaunch_s:.3g} s, {self._failures()}")

    def line(self, choice: Choice, m: Measured) -> str:
        c = choice.cadence
        local = "local off" if not choice.local_every_steps else \
            f"local every {choice.local_every_steps} steps ({_duration(c.local_s or 0.0)})"
        saves = f"a durable save blocks {m.save_s:.3g} s ({_plural(m.saves, 'save')})"
        if self.local:
            saves += (f", a local save {m.local_save_s:.3g} s ({_plural(m.local_saves, 'save')}), the local tier "
                      f"recovers {100 * self.local_recovers:.0f}% of failures")
        return (f"checkpoint cadence auto: durable every {choice.every_steps} steps ({_duration(c.durable_s)}), "
                f"{local}; {saves}, relaunch {m.relaunch_s:.3g} s ({_plural(m.launches, 'launch')}), "
                f"step {m.step_s:.3g} s, {self._failures()}: expected goodput {100 * choice.goodput:.1f}%")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("ch") else "s")


def _count(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * HOUR:
        return f"{seconds / 60:.3g} min"
    if seconds < 2 * DAY:
        return f"{seconds / HOUR:.3g} h"
    return f"{seconds / DAY:,.0f} d" if seconds >= 100 * DAY else f"{seconds / DAY:.3g} d"
