"""specdraft: lossless speculative decoding with Gemma-4-style MTP drafters, in plain PyTorch.

Data flows one way: tokenize -> prefill -> (draft -> verify -> accept) -> detokenize.
"""

__version__ = "0.1.0"
