"""Continual-learning metrics, exactly as the papers define them (each paper's own definitions).

``acc[i][t]`` is the accuracy on task i's test classes after learning task t
(NaN for i > t). With T tasks (0-indexed here):

* A_t  = mean_{i<=t} acc[i][t]
* final average accuracy A_N = A_{T-1}
* average incremental accuracy AIA = mean_t A_t
* average forgetting F = mean_{i<T-1} max_{t<T-1} (acc[i][t] - acc[i][T-1])
* backward transfer BWT = mean_{i<T-1} (acc[i][T-1] - acc[i][i]), the BWT of Lopez-Paz and Ranzato,
  "Gradient Episodic Memory for Continual Learning" (NeurIPS 2017), its evaluation metrics:
  1/(T-1) sum_{i<T} (R_{T,i} - R_{i,i}), its 1-indexed R_{j,i} (task i after task j) our acc[i-1][j-1]

Forward transfer (the same paper's FWT) needs each task's accuracy before it is learnt and a
reference model's accuracy on it; a run scores only the tasks seen so far and trains no reference,
so forward transfer is reported only where a reference exists: Powder's random tasks
(:func:`asynchronous_summary`, against the single-task runs of server/transfer.py).
"""

from __future__ import annotations

import numpy as np


def empty_matrix(num_tasks: int) -> np.ndarray:
    return np.full((num_tasks, num_tasks), np.nan)


def average_accuracies(acc: np.ndarray, upto: int | None = None) -> np.ndarray:
    """A_t for t = 0..upto (default: the last task with any entry)."""
    last = acc.shape[1] - 1 if upto is None else upto
    return np.array([np.nanmean(acc[: t + 1, t]) for t in range(last + 1)])


def final_average_accuracy(acc: np.ndarray, upto: int | None = None) -> float:
    return float(average_accuracies(acc, upto)[-1])


def average_incremental_accuracy(acc: np.ndarray, upto: int | None = None) -> float:
    return float(np.mean(average_accuracies(acc, upto)))


def average_forgetting(acc: np.ndarray, upto: int | None = None, include_last: bool = False) -> float:
    """Mean over old tasks of the largest drop from an earlier accuracy to the final one.

    ``include_last=True`` averages over all tasks seen (the last contributes 0),
    as FPPL's code does; the papers' definition (default) averages over i < T-1.
    Returns 0.0 when only one task has been learnt.
    """
    last = acc.shape[1] - 1 if upto is None else upto
    if last == 0:
        return 0.0
    drops = task_forgetting(acc, last)
    if include_last:
        return float(np.sum(drops) / (last + 1))
    return float(np.mean(drops))


def task_forgetting(acc: np.ndarray, upto: int | None = None) -> np.ndarray:
    """Per old task i < ``upto``: its largest earlier accuracy minus its accuracy after task ``upto``."""
    last = acc.shape[1] - 1 if upto is None else upto
    return np.array([np.nanmax(acc[i, i:last]) - acc[i, last] for i in range(last)])


def backward_transfer(acc: np.ndarray, upto: int | None = None) -> float | None:
    """GEM's backward transfer after task ``upto`` (default: the last column).

    The mean over old tasks i < ``upto`` of acc[i][upto] - acc[i][i]: how learning the later
    tasks changed task i's accuracy from just after it was learnt (negative: forgetting). Unlike
    :func:`average_forgetting` it compares with the accuracy right after task i, not the best one.

    Parameters
    ----------
    acc : np.ndarray
        The accuracy matrix, ``acc[i][t]`` on task i after task t; NaN where not evaluated.
    upto : int, optional
        The last learnt task (0-based).

    Returns
    -------
    float or None
        None when it is undefined: only one task learnt (1/(T-1) with T = 1), or no old task
        has both its cells. An old task missing either cell is left out of the mean rather
        than guessed.
    """
    last = acc.shape[1] - 1 if upto is None else upto
    changes = acc[:last, last] - np.diagonal(acc)[:last]
    changes = changes[~np.isnan(changes)]
    return float(np.mean(changes)) if len(changes) else None


def summary(acc: np.ndarray, upto: int | None = None) -> dict[str, float | None]:
    """A_N, AIA, forgetting and backward transfer after task ``upto`` (default: the last)."""
    return {
        "final_average_accuracy": final_average_accuracy(acc, upto),
        "average_incremental_accuracy": average_incremental_accuracy(acc, upto),
        "average_forgetting": average_forgetting(acc, upto),
        "backward_transfer": backward_transfer(acc, upto),
    }


# ---------------------------------------------------------------------------- asynchronous tasks
# Powder's metrics (Powder, section 5.1) for runs where every task belongs to one client
# and tasks start and finish at different rounds. ``acc[g, r]`` is the accuracy on task g
# after round r (NaN before g starts); ``evaluation_rounds`` is the paper's R, the rounds
# with a task switch (taken as the last round before each switch point, and the last round).
def asynchronous_summary(acc: np.ndarray, finish: np.ndarray, evaluation_rounds: list[int],
                         single_task: np.ndarray | None = None) -> dict[str, float]:
    """AIA, FM, and (with the single-task reference accuracies) FT, BT and CT.

    * AIA = mean over r in R of the mean accuracy of the tasks existing at r;
    * FM  = mean over r in R of the mean over tasks with an earlier evaluation of
      (their highest accuracy in any round before r) - (their accuracy at r), over the r
      at which some task has an earlier evaluation;
    * FT  = mean_g acc[g, finish_g] - single_g (knowledge transferred into g while it trained);
    * BT  = mean_g acc[g, last] - acc[g, finish_g] (what later tasks gave back to g);
    * CT  = mean_g acc[g, last] - single_g = FT + BT.
    """
    last = acc.shape[1] - 1
    incremental, forgetting = [], []
    for r in evaluation_rounds:
        existing = ~np.isnan(acc[:, r])
        incremental.append(float(np.mean(acc[existing, r])))
        drops = [np.nanmax(acc[g, :r]) - acc[g, r] for g in np.flatnonzero(existing)
                 if r > 0 and not np.all(np.isnan(acc[g, :r]))]
        if drops:
            forgetting.append(float(np.mean(drops)))
    tasks = np.arange(acc.shape[0])
    at_finish, at_end = acc[tasks, finish], acc[:, last]
    out = {
        "average_incremental_accuracy": float(np.mean(incremental)),
        "forgetting_measure": float(np.mean(forgetting)) if forgetting else 0.0,
        "final_accuracy": float(np.mean(at_end)),
        "backward_transfer": float(np.mean(at_end - at_finish)),
    }
    if single_task is not None:
        out["forward_transfer"] = float(np.mean(at_finish - single_task))
        out["combined_transfer"] = float(np.mean(at_end - single_task))
    return out
