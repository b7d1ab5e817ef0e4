"""A small byte-level BPE tokenizer built offline, for synthetic models."""

from pathlib import Path

_CORPUS = """
Mixture-of-experts language models route every token through a few experts per layer.
The experts live on the SSD and stream into a shared cache in memory when the router asks.
One daemon reads each expert once and every client process maps the same rows.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Once upon a time there was a small model that ran on a laptop bigger than itself.
def main(): print("hello, world") ; for i in range(10): total += i * 2
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation , . ; : ! ? ( ) [ ] { } " ' - _
"""


def build_tokenizer(out_dir: Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE tokenizer on a built-in text and save it for mlx-lm.

    Returns:
        The tokenizer's vocabulary size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|bos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|bos|>"
    )
    fast.save_pretrained(str(out_dir))
    return tok.get_vocab_size()
