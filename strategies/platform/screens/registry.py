"""The screens a defended run applies, in the order the platform applies them to the replies that
passed the record checks. A new screen is its own module (a :class:`~.base.Screen`: built from the
robustness section, its state and checkpoint entry its own) and one line here."""

from __future__ import annotations

from .base import Screen
from .clip import NormHistory, UpdateClip
from .cosines import MedianCosines
from .direction import DirectionCheck, DirectionHistory
from .norm_filter import LongReply, NormFilter
from .strikes import Strikes

SCREENS: tuple[type[Screen], ...] = (
    Strikes,  # clients struck out earlier are excluded; the later screens' flags are strikes
    MedianCosines,  # each reply's cosine with its task's median update (recorded in every round)
    NormFilter,  # update-norm-factor, max-update-norm: against the round's lower median norm
    NormHistory,  # each task's reference norm and count, read from what the norm filter kept
    DirectionCheck,  # update-min-cosine, update-reversed-norm
    LongReply,  # update-strike-norm
    DirectionHistory,  # update-mean-cosine over each client's replies
    UpdateClip,  # update-clip, update-clip-by-count
)
