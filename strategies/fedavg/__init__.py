"""FedAvg-Prompt: CODA-P clients and sample-weighted averaging, the papers' common baseline."""

from ..registry import Method

# FedAvg has no paper of its own here: the prompt it averages is CODA-Prompt's (the paper is not among
# the texts this project holds, so the entry is as Powder's references print it)
CITATION = """\
@inproceedings{smith2023codaprompt,
  title = {CODA-Prompt: COntinual Decomposed Attention-based Prompting for Rehearsal-Free Continual Learning},
  author = {Smith, James Seale and Karlinsky, Leonid and Gutta, Vyshnavi and Cascante-Bonilla, Paola and
    Kim, Donghyun and Arbelle, Assaf and Panda, Rameswar and Feris, Rogerio and Kira, Zsolt},
  booktitle = {Proceedings of the IEEE/CVF Conference on Computer Vision and Pattern Recognition (CVPR)},
  pages = {11909--11919},
  year = {2023},
}"""

METHOD = Method("fedavg", strategy=".strategy:FedAvgStrategy", learner=".learner:FedAvgLearner",
                prompt=".prompt:FedAvgPrompt", options=".options:FedAvgOptions",
                citation=CITATION)
