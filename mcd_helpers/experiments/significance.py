"""Statistics over seeds: Student-t confidence intervals and paired differences, through
``scipy.stats``.

Rows are result dicts as in the benchmark's ``results.json``: grouping keys (``task``,
``class_split``, ``protocol``, ``selection``, ``method``, ``strategy``, ...), a ``seed`` and metrics
as fractions in [0, 1], which stay fractions here. For n values with mean m and sample standard
deviation s, the interval is ``m ± t_{(1+c)/2, n-1} s / sqrt(n)`` (``scipy.stats.t.interval``); the
paired test of d = a - b is the two-sided paired t-test (``scipy.stats.ttest_rel``). The two agree:
p < 1 - c exactly when the interval excludes 0 (NIST/SEMATECH e-Handbook of Statistical Methods,
7.2.2 and 7.3.1).
"""

import math
from typing import Sequence

import numpy as np
from scipy import optimize, stats
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.weightstats import ttost_paired

GROUP_KEYS = ("task", "class_split", "protocol", "selection", "method")
EQUIVALENCE = 0.01  # TOST margin of endpoint_tests, in the metric's units: 1 pp


def mean_ci(values: Sequence[float], confidence: float = 0.95, where: str = "") -> dict:
    """Mean of ``values`` ``(n,)`` with its Student-t interval:
    ``{"mean", "low", "high", "half_width", "n"}``.

    Raises:
        ValueError: fewer than 2 values, a NaN or inf (its index named), a confidence outside (0,
            1); the message starts with ``where`` (the group) when given.
    """
    at = f"{where}: " if where else ""
    if not 0 < confidence < 1:
        hint = f" (did you mean {confidence / 100}?)" if 1 < confidence < 100 else ""
        raise ValueError(f"{at}confidence must be a fraction in (0, 1), got {confidence}{hint}.")
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size < 2:
        raise ValueError(
            f"{at}a confidence interval needs at least 2 values (seeds), got {x.size}; run "
            "more seeds."
        )
    if (bad := np.flatnonzero(~np.isfinite(x))).size:
        raise ValueError(
            f"{at}values hold {bad.size} NaN or inf value(s), first at index {bad[0]}: a "
            "failed run upstream."
        )
    m, half = (
        float(x.mean()),
        float(stats.t.ppf((1 + confidence) / 2, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size)),
    )
    return {"mean": m, "low": m - half, "high": m + half, "half_width": half, "n": int(x.size)}


def _groups(rows: Sequence[dict], keys: Sequence[str], metric: str) -> dict[tuple, list[tuple]]:
    """``{key values: [(row's strategy, seed, metric value), ...]}``; ValueError naming a row
    without a field."""
    out: dict[tuple, list[tuple]] = {}
    for i, row in enumerate(rows):
        missing = [k for k in (*keys, "strategy", "seed") if k not in row] + (
            [metric] if row.get(metric) is None else []
        )
        if missing:
            raise ValueError(f"row {i} has no field(s) {missing}; its fields are {sorted(row)}.")
        out.setdefault(tuple(row[k] for k in keys), []).append(
            (row["strategy"], row["seed"], float(row[metric]))
        )
    return out


def summarize(
    rows: Sequence[dict],
    metrics: Sequence[str] = ("auroc", "fpr95", "id_accuracy"),
    keys: Sequence[str] = GROUP_KEYS + ("strategy",),
    confidence: float = 0.95,
) -> list[dict]:
    """Per group of rows equal on ``keys`` (in order of first appearance): the keys, ``n`` and
    ``{metric: mean_ci(values)}``. ValueError: a missing field, a group of one row or a NaN (named).
    """
    groups = {}
    for metric in metrics:
        for key, members in _groups(rows, keys, metric).items():
            groups.setdefault(key, {**dict(zip(keys, key)), "n": len(members)})[metric] = mean_ci(
                [v for _, _, v in members], confidence, f"group {dict(zip(keys, key))}, {metric}"
            )
    return list(groups.values())


def paired_differences(
    rows: Sequence[dict],
    a: str = "concat",
    b: str = "separate",
    metric: str = "auroc",
    keys: Sequence[str] = GROUP_KEYS,
    confidence: float = 0.95,
) -> list[dict]:
    """Paired differences ``a - b`` of two strategies per group of ``keys``, matched by seed.

    Returns:
        per group where both strategies ran: the keys, ``metric``, ``a``, ``b``, ``seeds`` and
        ``diffs`` (by seed), the :func:`mean_ci` of the differences and ``p_value`` of the paired
        t-test (NaN when every difference is equal).

    Raises:
        ValueError: a missing field, a seed twice or for one strategy only (named), fewer than 2
        pairs.
    """
    out = []
    for key, members in _groups(
        [r for r in rows if r.get("strategy") in (a, b)], keys, metric
    ).items():
        by = {a: {}, b: {}}
        for strategy, seed, value in members:
            if seed in by[strategy]:
                raise ValueError(
                    f"seed {seed} appears twice for strategy {strategy!r} in group "
                    f"{dict(zip(keys, key))}."
                )
            by[strategy][seed] = value
        if not by[a] or not by[b]:
            continue  # only one of the two ran in this group: nothing to pair
        if set(by[a]) != set(by[b]):
            raise ValueError(
                f"unmatched seeds in group {dict(zip(keys, key))}: "
                f"{sorted(set(by[a]) ^ set(by[b]))} only "
                "for one strategy; pairs need the same seeds for both."
            )
        seeds = sorted(by[a])
        xa, xb = np.array([by[a][s] for s in seeds]), np.array([by[b][s] for s in seeds])
        ci = mean_ci(xa - xb, confidence, f"group {dict(zip(keys, key))}")
        p = (
            float("nan")
            if np.all(xa - xb == (xa - xb)[0])
            else float(stats.ttest_rel(xa, xb).pvalue)
        )
        out.append(
            {
                **dict(zip(keys, key)),
                "metric": metric,
                "a": a,
                "b": b,
                "seeds": seeds,
                "diffs": (xa - xb).tolist(),
                **ci,
                "p_value": p,
            }
        )
    return out


def _sign_and_tost(diffs: list[float], equivalence: float) -> dict:
    """The exact two-sided sign test over the non-zero differences (NaN when all are 0) and the
    TOST equivalence p within ``± equivalence``."""
    nonzero = [x for x in diffs if x != 0]
    sign = (
        stats.binomtest(sum(x > 0 for x in nonzero), len(nonzero)).pvalue if nonzero else math.nan
    )
    with np.errstate(divide="ignore", invalid="ignore"):  # equal differences: t = ±inf, p 0 or 1
        d = np.asarray(diffs, float)
        tost = ttost_paired(d, np.zeros(len(d)), -equivalence, equivalence)[0]
    return {"sign_p": float(sign), "tost_p": float(tost)}


def endpoint_tests(
    rows: Sequence[dict],
    endpoints: Sequence[Sequence[str]],
    confidence: float = 0.95,
    equivalence: float = EQUIVALENCE,
) -> list[dict]:
    """The pre-registered endpoints of a benchmark: for each ``(a, b, metric, eval_stats)`` the
    paired differences ``a - b`` of MCD on the BatchNorm network (rows with that ``eval_stats``),
    one group per :data:`GROUP_KEYS`: :func:`paired_differences`' fields plus ``role``
    (``"primary"`` for the first endpoint, else ``"secondary"``), ``eval_stats``, ``sign_p`` (the
    exact two-sided sign test, ``scipy.stats.binomtest``; NaN when every difference is 0),
    ``holm_p`` (the paired t p-value, or the sign test's where every difference is equal,
    Holm-adjusted over the secondaries as one family, ``statsmodels``' ``multipletests``, Holm 1979,
    Scand. J. Statist. 6:65-70; the primary's unadjusted) and ``tost_p`` (the two one-sided paired
    t-tests, Schuirmann 1987, J. Pharmacokinet. Biopharm. 15:657, that the mean difference lies
    within ``± equivalence``, in the metric's units; ``ttost_paired``; p < 0.05 shows equivalence).

    Raises:
        ValueError: an endpoint with no pairs in ``rows`` (named), and as
            :func:`paired_differences`.
    """
    out = []
    for i, (a, b, metric, eval_stats) in enumerate(endpoints):
        mine = [r for r in rows if r.get("method") == "mcd" and r.get("norm", "batch") == "batch"]
        mine = [r for r in mine if r.get("eval_stats", "running") == eval_stats]
        found = paired_differences(mine, a, b, metric, GROUP_KEYS, confidence)
        if not found:
            raise ValueError(
                f"endpoint {a} - {b} ({metric}, {eval_stats} statistics) has no paired rows."
            )
        role = "secondary" if i else "primary"
        out += [
            {**d, "role": role, "eval_stats": eval_stats, **_sign_and_tost(d["diffs"], equivalence)}
            for d in found
        ]
    second = [d for d in out if d["role"] == "secondary"]
    # a t-test p of NaN (every difference equal): the exact sign test's p instead (1 when they are
    # all 0)
    p = [d["sign_p"] if math.isnan(d["p_value"]) else d["p_value"] for d in second]
    p = [1.0 if math.isnan(x) else x for x in p]
    for d, adjusted in zip(second, multipletests(p, method="holm")[1] if p else []):
        d["holm_p"] = float(adjusted)
    for d in out:
        d.setdefault("holm_p", d["p_value"])
    return out


def _reml(d: np.ndarray, confidence: float) -> dict:
    """The balanced one-way random-effects model of ``d`` ``(k splits, n seeds)`` by REML in closed
    form (the one-way ANOVA's; Searle, Casella & McCulloch 1992, *Variance Components*, 3.6-3.7):
    mu with its interval, tau with its interval and the p-value of tau = 0, sigma, se and the
    prediction interval for a new split."""
    k, n = d.shape
    m = d.mean(1)  # (k,) split means
    msb, msw = n * m.var(ddof=1), float(((d - m[:, None]) ** 2).sum()) / (k * (n - 1))
    mu, tau2 = float(d.mean()), max(msb - msw, 0.0) / n
    sigma2 = msw if msb >= msw else float(d.var(ddof=1))
    se = math.sqrt((msb if msb >= msw else sigma2) / (k * n))
    half = float(stats.t.ppf((1 + confidence) / 2, k - 1)) * se
    pi = float(stats.t.ppf((1 + confidence) / 2, k - 2)) * math.sqrt(tau2 + se**2)
    tau_low, tau_high = _tau_interval(msb, msw, k, n, float(np.abs(d).max()), confidence)
    # tau = 0 tested exactly: MSB / MSW ~ F(k - 1, k (n - 1)) (Searle, Casella & McCulloch 3.5)
    tau_p = float(stats.f.sf(msb / msw, k - 1, k * (n - 1))) if msw > 0 else math.nan
    return {
        **{"mean": mu, "low": mu - half, "high": mu + half, "se": se},
        **{
            "tau": math.sqrt(tau2),
            "tau_low": tau_low,
            "tau_high": tau_high,
            "tau_p": tau_p,
            "sigma": math.sqrt(sigma2),
            "pi_low": mu - pi,
            "pi_high": mu + pi,
        },
    }


def _reml_loglik(tau2: float, sigma2: float, ssb: float, ssw: float, k: int, n: int) -> float:
    """The REML log-likelihood of the balanced one-way random-effects model, up to a constant:
    ``-1/2 [(k-1) log(s2 + n t2) + k(n-1) log s2 + SSB / (s2 + n t2) + SSW / s2]`` (Searle, Casella
    & McCulloch 1992, 6.7), with SSB ``n sum_i (m_i - m)^2`` and SSW ``sum_ij (d_ij - m_i)^2``."""
    between = sigma2 + n * tau2
    return -0.5 * (
        (k - 1) * math.log(between) + k * (n - 1) * math.log(sigma2) + ssb / between + ssw / sigma2
    )


def _tau_interval(
    msb: float, msw: float, k: int, n: int, scale: float, confidence: float
) -> tuple[float, float]:
    """The profile-likelihood interval of tau for ``k`` splits of ``n`` seeds with between- and
    within-split mean squares ``msb``, ``msw``: every tau whose REML log-likelihood, maximised over
    sigma, is within ``chi2_1(confidence) / 2`` of the maximum at the REML estimate (Pawitan 2001,
    *In All Likelihood*, 2.6). The lower end is 0 when tau = 0 is inside; the chi2_1 cut-off is not
    corrected for that boundary, so it keeps tau = 0 more often than a test at ``1 - confidence``
    would (:func:`_reml`'s ``tau_p`` is that test). Computed in units of the within-split SD (the
    interval scales with the data); NaN when that SD is 0 to rounding against ``scale``, the
    largest |difference|, or not finite (the likelihood has no maximum then)."""
    if not msw > (1e-9 * scale) ** 2:  # also False for NaN
        return math.nan, math.nan
    within = math.sqrt(msw)
    # the sums of squares in units of msw: within-split variance 1
    ssb, ssw, t2_hat = (k - 1) * msb / msw, k * (n - 1), max(msb / msw - 1, 0.0) / n

    def profile(t2: float) -> float:  # the log-likelihood at tau^2 = t2, maximised over sigma^2
        best = optimize.minimize_scalar(
            lambda log_s2: -_reml_loglik(t2, math.exp(log_s2), ssb, ssw, k, n), bracket=(-1, 1)
        )
        return -float(best.fun)

    drop = float(stats.chi2.ppf(confidence, 1)) / 2
    top = profile(t2_hat)

    def gap(t2: float) -> float:
        return top - profile(t2) - drop

    low = 0.0 if gap(0.0) <= 0 else optimize.brentq(gap, 0.0, t2_hat)
    high = max(t2_hat, ssb / (k - 1) / n, 1.0)
    while gap(high) < 0:  # widen until the upper end is bracketed
        high *= 4
    return within * math.sqrt(low), within * math.sqrt(optimize.brentq(gap, t2_hat, high))


def _covariate_fit(rows, pairs, where: set, covariate: str, metric: str) -> tuple[list, dict]:
    """Per split its mean difference and the mean ``metric`` of method ``covariate`` there (NaN
    where it did not run), and the split means regressed on it (``scipy.stats.linregress``; NaN with
    fewer than 3 splits that have it)."""
    cov = {}
    for r in rows:
        same_cell = (r.get("task"), r.get("protocol"), r.get("selection")) in where
        if r.get("method") == covariate and r.get("norm", "batch") == "batch" and same_cell:
            cov.setdefault(r["class_split"], []).append(float(r[metric]))
    splits = []
    for p in pairs:
        value = float(np.mean(cov[p["class_split"]])) if p["class_split"] in cov else math.nan
        mean, seeds = float(np.mean(p["diffs"])), len(p["diffs"])
        splits.append(
            {"class_split": p["class_split"], "mean": mean, "seeds": seeds, "covariate": value}
        )
    x, y = np.array([s["covariate"] for s in splits]), np.array([s["mean"] for s in splits])
    x, y = x[np.isfinite(x)], y[np.isfinite(x)]
    reg = stats.linregress(x, y) if x.size >= 3 and np.ptp(x) > 0 else None
    fit = {"slope": reg.slope, "slope_p": reg.pvalue, "r": reg.rvalue} if reg else {}
    return splits, {k: float(fit.get(k, math.nan)) for k in ("slope", "slope_p", "r")}


def split_effects(
    rows: Sequence[dict],
    a: str = "concat",
    b: str = "separate",
    metric: str = "auroc",
    covariate: str = "msp",
    confidence: float = 0.95,
) -> dict:
    """The effect ``a - b`` of MCD (BatchNorm network, running statistics) over class splits, with
    the split as a random effect: ``d_ij = mu + u_i + e_ij`` for split i and seed j,
    ``u_i ~ N(0, tau^2)``, ``e_ij ~ N(0, sigma^2)``, fitted by REML, in closed form with the same
    number n >= 2 of seeds in every split (a benchmark runs every seed on every split).

    Returns:
        ``{"mean", "low", "high"}`` (mu and its interval, Student t with k - 1 df), ``se``, ``tau``
        (the between-split SD) with ``tau_low, tau_high`` (its profile-likelihood interval, NaN
        without within-split spread) and ``tau_p`` (the exact F test of tau = 0), ``sigma`` (the
        within-split SD), ``pi_low, pi_high`` (the prediction interval for a new
        split's effect, ``mu ± t_{k-2} sqrt(tau^2 + se^2)``, Higgins, Thompson &
        Spiegelhalter 2009, J. R. Stat. Soc. A 172:137), ``k`` splits, ``n`` pairs, ``splits`` (per
        split: ``class_split``, ``mean``, ``seeds``, ``covariate``: the mean ``metric`` of method
        ``covariate`` there) and ``slope``, ``slope_p``, ``r``: the split means regressed on the
        covariate. All in the metric's units (fractions).

    Raises:
        ValueError: fewer than 3 splits, a split with one seed (:func:`paired_differences`), splits
            with different numbers of seeds, rows of more than one task, protocol or selection.
    """
    running = [
        r.get("norm", "batch") == "batch" and r.get("eval_stats", "running") == "running"
        for r in rows
    ]
    mcd = [r for r, ok in zip(rows, running) if ok and r.get("method") == "mcd"]
    pairs = paired_differences(mcd, a, b, metric, GROUP_KEYS, confidence)
    if len(where := {(d["task"], d["protocol"], d["selection"]) for d in pairs}) > 1:
        raise ValueError(
            "split_effects takes the rows of one task, protocol and selection; filter them first."
        )
    if (k := len(pairs)) < 3:
        raise ValueError(
            f"a random split effect needs at least 3 class splits with both {a!r} and "
            f"{b!r}, got {k}."
        )
    sizes = {p["class_split"]: len(p["diffs"]) for p in pairs}
    if len(set(sizes.values())) > 1:
        raise ValueError(
            "split_effects needs the same number of seeds in every class split, got "
            f"{sizes}; run the same seeds on every split or leave the short splits out."
        )
    d = np.array([p["diffs"] for p in pairs])  # (k splits, n seeds)
    splits, fit = _covariate_fit(rows, pairs, where, covariate, metric)
    about = {"a": a, "b": b, "metric": metric, "k": k, "n": int(d.size), "covariate": covariate}
    return {**about, **_reml(d, confidence), "splits": splits, **fit}


def hodges_lehmann(diffs: Sequence[float], confidence: float = 0.95, seed: int = 0) -> dict:
    """The one-sample Hodges–Lehmann shift of paired differences: the median of the Walsh averages
    ``(d_i + d_j) / 2, i <= j`` (Hodges & Lehmann 1963, Ann. Math. Stat. 34:598), with a BCa
    bootstrap interval (``scipy.stats.bootstrap``, 9,999 resamples, ``seed``); beside it the median.
    Robust to the heavy tails a collapsed run leaves, where the mean and its t interval are not.

    Returns:
        ``{"median", "hl", "hl_low", "hl_high", "n"}`` in the units of ``diffs``.

    Raises:
        ValueError: fewer than 3 differences (no interval).
    """
    d = np.asarray(diffs, float)
    if d.size < 3:
        raise ValueError(f"a Hodges–Lehmann interval needs at least 3 differences, got {d.size}.")

    def hl(x, axis=-1):
        i, j = np.triu_indices(x.shape[axis])
        return np.median((np.take(x, i, axis) + np.take(x, j, axis)) / 2, axis=axis)

    if np.ptp(d) == 0:  # every difference equal: no spread to resample
        low = high = float(d[0])
    else:
        ci = stats.bootstrap(
            (d,), hl, confidence_level=confidence, n_resamples=9999, rng=seed, method="BCa"
        ).confidence_interval
        low, high = float(ci.low), float(ci.high)
    return {
        "median": float(np.median(d)),
        "hl": float(hl(d)),
        "hl_low": low,
        "hl_high": high,
        "n": d.size,
    }


def collapse_rate(values: Sequence[float], threshold: float, confidence: float = 0.95) -> dict:
    """How many runs collapsed, ``value < threshold`` (e.g. AUROC below a registered level), with
    the exact Clopper–Pearson interval of the rate (``scipy.stats.binomtest(...).proportion_ci``).

    Returns:
        ``{"collapsed", "n", "rate", "low", "high"}``.

    Raises:
        ValueError: no values.
    """
    v = np.asarray(values, float)
    if v.size == 0:
        raise ValueError("collapse_rate needs at least one value.")
    k = int((v < threshold).sum())
    ci = stats.binomtest(k, v.size).proportion_ci(confidence, method="exact")
    return {"collapsed": k, "n": int(v.size), "rate": k / v.size, "low": ci.low, "high": ci.high}
