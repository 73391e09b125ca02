"""Powder ("Federated Continual Learning via Prompt-based Dual Knowledge Transfer"): task and class
correlation, two-step prompt aggregation, per-client top-k payloads, dual distillation."""

from ..registry import Method

CITATION = """\
@inproceedings{piao2024powder,
  title = {Federated Continual Learning via Prompt-based Dual Knowledge Transfer},
  author = {Piao, Hongming and Wu, Yichen and Wu, Dapeng and Wei, Ying},
  booktitle = {Proceedings of the 41st International Conference on Machine Learning},
  series = {Proceedings of Machine Learning Research},
  volume = {235},
  address = {Vienna, Austria},
  year = {2024},
}"""

METHOD = Method("powder", strategy=".strategy:PowderStrategy", learner=".learner:PowderLearner",
                prompt=".prompt:PowderPrompt", options=".options:PowderOptions", statistics=".records:STATISTICS",
                citation=CITATION)
