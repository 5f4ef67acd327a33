"""A character-level tokenizer for the zoo's random-weight models.

It is a real HF tokenizer (``PreTrainedTokenizerFast`` over a ``tokenizers`` word-level model that sees one
character per token) laid over the model's vocabulary: the config's bos / eos / pad ids keep their meaning, the
printable ASCII characters, newline and tab take the next free ids from ``FIRST`` on, any other character is
``<unk>``, and every id left decodes as ``<tN>``. Text prompts, chat templates and ``hybrid serve`` then work on zoo
models; what the models write back is as random as their weights.
"""
from __future__ import annotations

FIRST = 8  # ids below this are kept for special tokens (the zoo's configs use 0-2)
CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
#: role-prefixed lines, then the assistant's prefix when a reply is asked for
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def _special_ids(config) -> dict[str, int]:
    """Special token name -> id from the config; one name where several roles share an id."""
    names = {}
    for role, name in (("eos_token_id", "</s>"), ("bos_token_id", "<s>"), ("pad_token_id", "<pad>")):
        value = getattr(config, role, None)
        value = value[0] if isinstance(value, (list, tuple)) and value else value
        if isinstance(value, int) and value not in names.values():
            names[name] = value
    return names


def char_tokenizer(config):
    """The tokenizer for a model with this (text) config; needs a vocabulary of at least ``FIRST + len(CHARS)``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    config = config.get_text_config()
    if config.vocab_size < FIRST + len(CHARS):
        raise ValueError(f"a character tokenizer needs a vocabulary of {FIRST + len(CHARS)} ids or more, the model "
                         f"has {config.vocab_size}")
    specials = _special_ids(config)
    vocab = dict(specials)
    taken = set(vocab.values())
    free = (i for i in range(config.vocab_size) if i not in taken)
    vocab["<unk>"] = next(free)
    taken.add(vocab["<unk>"])
    free = (i for i in range(FIRST, config.vocab_size) if i not in taken)
    for ch, i in zip(CHARS, free):
        vocab[ch] = i
    used = set(vocab.values())  # the rest of the model's ids decode to a visible name (text never encodes to them)
    vocab.update({f"<t{i}>": i for i in range(config.vocab_size) if i not in used})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    roles = {"</s>": "eos_token", "<s>": "bos_token", "<pad>": "pad_token"}
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                  **{roles[name]: name for name in specials}, clean_up_tokenization_spaces=False)
    out.chat_template = CHAT_TEMPLATE
    return out
