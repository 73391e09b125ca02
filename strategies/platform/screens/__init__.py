"""Hostile-client defences on model updates: screens the platform applies, in order, to a round's
replies (strategies/platform/screens/registry.py), where the run is defended (``defences``,
common/config/trust.py): a simulation of this project's own clients computes each paper's
aggregation untouched. Each screen is one class in its own module, with its own state and
checkpoint entry; :class:`~.pipeline.UpdateScreen` runs them."""

from . import registry
from .base import CLIP, DIRECTION, NORM_FILTER, STRUCK_OUT, Screen, Screening, ScreenRound
from .clip import NormHistory, UpdateClip
from .cosines import MedianCosines
from .direction import DirectionCheck, DirectionHistory
from .norm_filter import LongReply, NormFilter
from .pipeline import UpdateScreen
from .registry import SCREENS
from .strikes import Strikes

__all__ = ["CLIP", "DIRECTION", "NORM_FILTER", "SCREENS", "STRUCK_OUT", "DirectionCheck", "DirectionHistory",
           "LongReply", "MedianCosines", "NormFilter", "NormHistory", "Screen", "ScreenRound", "Screening",
           "Strikes", "UpdateClip", "UpdateScreen", "registry"]
