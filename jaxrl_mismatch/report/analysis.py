"""Figures of `jaxrl-mismatch analyze` (jobs/analyze_*.py compute; this module only draws).

`plot_pairs`: one column per (trainer, engine) precision pair, like the FP16 paper's Fig. 2 —
(a) π vs μ per token (hexbin density, since a run has 10⁴–10⁶ tokens; PCC annotated as in the
objective-level hacking paper's Fig. 3), (b) the sequence log-ratio log π(y)/μ(y) against response length
(2-D histogram + binned means; FP16 paper Fig. 2, right), and a bottom row (c) with ρ mean ± std per π
probability bucket of every pair (objective-level hacking paper Fig. 7a).

`plot_softmax_simulation`: the objective-level hacking paper's Fig. 13 — the distribution of sampled tokens'
probabilities computed in float32 (left) and in the low precision (right), one colour per seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

from jaxrl_mismatch.report.plot import save_figure  # noqa: E402

# (label, per-token dump, summary, response lengths [seqs], sequence log-ratios [seqs])
PairData = tuple[str, dict, dict, np.ndarray, np.ndarray]


def _scatter(ax, dump: dict, summary: dict, axes: str) -> None:
    lp_tr, lp_ro = dump["logp_train"].astype(np.float64), dump["logp_rollout"].astype(np.float64)
    if axes == "prob":
        x, y, lo = np.exp(lp_tr), np.exp(lp_ro), 0.0
        hi, label = 1.0, "{} probability"
    else:
        x, y = lp_tr, lp_ro
        lo = float(min(x.min(), y.min())) if x.size else -1.0
        lo = min(lo, -1.0)  # every log-prob 0 (greedy, a certain model) gave an empty extent: no figure
        hi, label = 0.0, "log {} probability"
    if x.size:
        hb = ax.hexbin(x, y, gridsize=60, bins="log", mincnt=1, extent=(lo, hi, lo, hi), cmap="viridis")
        plt.colorbar(hb, ax=ax, label="tokens")
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel(label.format("trainer π"))
    ax.set_ylabel(label.format("engine μ"))
    ax.text(0.03, 0.95, f"PCC {summary['mismatch/prob_pearson']:.6f}\nmax |Δlog p| "
            f"{summary['analysis/logp_abs_diff_max']:.2e}", transform=ax.transAxes, va="top", fontsize=8,
            bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})


def _seq_ratio(ax, lengths: np.ndarray, seq_lr: np.ndarray, ylim: float) -> None:
    lengths = np.asarray(lengths, np.float64)
    distinct = np.unique(lengths)
    if distinct.size > 1:
        edges = (np.arange(distinct.min() - 0.5, distinct.max() + 1.5) if distinct.max() - distinct.min() < 60
                 else np.linspace(distinct.min(), distinct.max() + 1, 31))
    else:
        edges = np.array([distinct[0] - 0.5, distinct[0] + 0.5]) if distinct.size else np.array([0.0, 1.0])
    y_edges = np.linspace(-ylim, ylim, 41)
    if lengths.size:
        h = ax.hist2d(lengths, np.clip(seq_lr, -ylim, ylim), bins=(edges, y_edges), norm=LogNorm(), cmap="magma_r",
                      cmin=1)
        plt.colorbar(h[3], ax=ax, label="sequences")
        which = np.clip(np.digitize(lengths, edges) - 1, 0, len(edges) - 2)
        centers, means = [], []
        for b in np.unique(which):
            centers.append(0.5 * (edges[b] + edges[b + 1]))
            means.append(seq_lr[which == b].mean())
        ax.plot(centers, means, "o-", color="tab:blue", ms=3, lw=1, label="binned mean")
        ax.legend(loc="lower left", fontsize=7)
    ax.axhline(0.0, color="k", ls="--", lw=0.8)
    ax.set_ylim(-ylim, ylim)
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("log π(y) / μ(y)")


def plot_pairs(pairs: Sequence[PairData], bucket_suffixes: Sequence[str], out: str, *, axes: str = "prob") -> str:
    """One PNG for all precision pairs (see the module docstring); returns its path."""
    n = len(pairs)
    fig = plt.figure(figsize=(4.6 * n + 0.6, 11.5))
    grid = fig.add_gridspec(3, n, height_ratios=(1.0, 0.8, 0.7), hspace=0.45, wspace=0.55)
    ylim = max([float(np.max(np.abs(lr))) for *_, lr in pairs if lr.size] + [1e-6]) * 1.05
    for k, (label, dump, summary, lengths, seq_lr) in enumerate(pairs):
        ax = fig.add_subplot(grid[0, k])
        _scatter(ax, dump, summary, axes)
        ax.set_title(f"{label}\nlog_ppl_abs_diff {summary['mismatch/log_ppl_abs_diff']:.2e}, "
                     f"ρ std {summary['mismatch/rho_std']:.2e}", fontsize=9)
        _seq_ratio(fig.add_subplot(grid[1, k]), lengths, seq_lr, ylim)
    ax = fig.add_subplot(grid[2, :])
    x = np.arange(len(bucket_suffixes), dtype=np.float64)
    width = 0.8 / max(n, 1)
    for k, (label, _, summary, _, _) in enumerate(pairs):
        mean = [summary[f"mismatch/rho_mean_{s}"] for s in bucket_suffixes]
        std = [summary[f"analysis/rho_std_{s}"] for s in bucket_suffixes]
        frac = [summary[f"mismatch/token_frac_{s}"] for s in bucket_suffixes]
        xs = x - 0.4 + width * (k + 0.5)
        keep = np.asarray(frac) > 0  # an empty bucket has no ρ to show
        ax.errorbar(xs[keep], np.asarray(mean)[keep], yerr=np.asarray(std)[keep], fmt="o", capsize=3, label=label)
        for xi, yi, fi in zip(xs[keep], np.asarray(mean)[keep], np.asarray(frac)[keep]):
            ax.annotate(f"{100 * fi:.0f}%", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=6)
    ax.axhline(1.0, color="r", ls="--", lw=0.8)
    ax.set_xticks(x, [s.removeprefix("pi_") for s in bucket_suffixes])
    ax.set_xlabel("π(θ_old) bucket (labels: share of tokens)")
    ax.set_ylabel("ρ = π/μ, mean ± std")
    ax.legend(fontsize=8)
    fig.suptitle("training–inference mismatch by precision pair (trainer:engine)", fontsize=11)
    save_figure(fig, out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def plot_softmax_simulation(samples: Sequence[tuple[np.ndarray, np.ndarray]], seeds: Sequence[int], setting: dict,
                            out: str) -> str:
    """Histograms of the sampled tokens' probabilities in float32 and in `setting['dtype']` (OLH Fig. 13)."""
    fig, axs = plt.subplots(1, 3, figsize=(15, 4))
    # Linear bins finer than bfloat16's level spacing above ~0.005 (2^-15 ≈ 3e-5), so its levels show as spikes.
    # The axis ends at the 98th percentile (the spikes need the fine bins); how many tokens lie past it is said.
    every = np.concatenate([p for pair in samples for p in pair])
    hi = float(np.quantile(every, 0.98))
    edges = np.linspace(0.0, hi, 600)
    panels = [np.concatenate([pair[i] for pair in samples]) for i in (0, 1)]
    for (p_ref, p_low), seed in zip(samples, seeds):
        axs[0].hist(p_ref, bins=edges, histtype="step", lw=0.8, label=f"seed {seed}")
        axs[1].hist(p_low, bins=edges, histtype="step", lw=0.8, label=f"seed {seed}")
        axs[2].hist(np.asarray(p_ref, np.float64) / p_low, bins=200, histtype="step", lw=0.8, label=f"seed {seed}")
    for ax, title, values in zip(axs[:2], ("float32", setting["dtype"]), panels):
        ax.set_xlabel(f"probability of the sampled token ({title}); {int(np.sum(values > hi))} of {values.size} "
                      f"> {hi:.3g} not shown")
        ax.set_ylabel("tokens")
        ax.set_title(f"computed in {title}")
    axs[2].set_xlabel(f"p_fp32 / p_{setting['dtype']}")
    axs[2].set_title("ratio at the sampled token")
    axs[2].legend(fontsize=7)
    fig.suptitle(f"softmax discretisation: V={setting['vocab']}, z~N(0,{setting['scale']}²), {setting['tokens']} "
                 f"tokens/seed, logits {setting['logits']}", fontsize=10)
    save_figure(fig, out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out
