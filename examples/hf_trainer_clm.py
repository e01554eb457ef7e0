"""transformers' ``run_clm.py`` on AdaptiveTrainer: a tiny GPT-2 trained from scratch on generated text.

A port of ``examples/pytorch/language-modeling/run_clm.py`` (argument
dataclasses parsed with ``HfArgumentParser`` next to ``TrainingArguments``,
tokenize, ``group_texts`` into blocks, ``Trainer``, ``train(resume_from_checkpoint=...)``,
``save_model``, ``evaluate``, perplexity), reduced to what runs offline: the
corpus is generated from a small grammar, the tokenizer is a word-level
``tokenizers`` model built here, and the model a random-init GPT-2 with a
small vocabulary.  The lines that change for the library are marked
``# adaptive:``.  Nothing is downloaded.

    pip install -e ".[huggingface]"
    python examples/hf_trainer_clm.py
    adaptive-run --standalone --nproc-per-node=2 examples/hf_trainer_clm.py

Stop it (Ctrl-C, SIGTERM to adaptive-run) and run the same command again
with any number of processes: it resumes at the exact sample, with the
global batch of its first launch, and prints the final evaluation loss.
Any ``TrainingArguments`` option can be given as in ``run_clm.py``
(``--per_device_train_batch_size 4 --save_steps 10 --resume_from_checkpoint ...``).
See docs/trainer.md.
"""

import logging
import math
import random
import sys
from dataclasses import dataclass, field
from itertools import chain

try:
    import numpy as np
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (AutoModelForCausalLM, GPT2Config, HfArgumentParser, PreTrainedTokenizerFast,
                              TrainingArguments, default_data_collator, set_seed)

    from adaptive.integrations.transformers import AdaptiveTrainer  # adaptive: was `from transformers import Trainer`
except ImportError as error:
    raise SystemExit(f'this example needs transformers and tokenizers ({error}): pip install "adaptive-elastic'
                     '[huggingface]" (in a checkout: pip install -e ".[huggingface]")') from None

logger = logging.getLogger("hf_trainer_clm")

#: What the script runs with when the command line does not say otherwise (the command line wins).
DEFAULTS = ["--output_dir", "hf_trainer_clm_out", "--do_train", "--do_eval", "--per_device_train_batch_size", "8",
            "--per_device_eval_batch_size", "16", "--num_train_epochs", "3", "--learning_rate", "3e-3",
            "--warmup_steps", "5", "--lr_scheduler_type", "linear", "--logging_steps", "10",
            "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "True", "--seed", "42"]

SUBJECTS = ["the cat", "a dog", "the bird", "my friend", "the teacher", "a child", "the farmer", "our neighbour"]
VERBS = ["sees", "likes", "follows", "finds", "helps", "calls", "watches"]
OBJECTS = ["the ball", "a red car", "the old house", "a small boat", "the river", "the garden", "a green apple"]
ENDINGS = ["", "today", "again", "at night", "every morning", "quietly"]
EOS = "[EOS]"


@dataclass
class ModelArguments:
    """The model trained from scratch (run_clm.py's ``--model_type gpt2 --config_overrides``)."""

    n_embd: int = field(default=64, metadata={"help": "hidden size"})
    n_layer: int = field(default=2, metadata={"help": "transformer blocks"})
    n_head: int = field(default=2, metadata={"help": "attention heads"})


@dataclass
class DataTrainingArguments:
    """The generated corpus and its blocks (run_clm.py's data arguments, without files or hub datasets)."""

    corpus_lines: int = field(default=800, metadata={"help": "sentences generated"})
    corpus_seed: int = field(default=1234, metadata={"help": "seed of the generated corpus"})
    validation_split_percentage: int = field(default=10, metadata={"help": "share of sentences kept for eval"})
    block_size: int = field(default=16, metadata={"help": "tokens per training sample"})
    max_train_samples: int | None = field(default=None, metadata={"help": "truncate the training blocks"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "truncate the evaluation blocks"})


def generate_corpus(lines: int, seed: int) -> list[str]:
    """Sentences of a small grammar, the same on every process (a stand-in for a text dataset)."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(lines):
        words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(ENDINGS), ".", EOS]
        sentences.append(" ".join(word for word in words if word))
    return sentences


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the grammar's words (run_clm.py loads one with ``AutoTokenizer``)."""
    words = sorted({word for phrase in SUBJECTS + VERBS + OBJECTS + ENDINGS for word in phrase.split()} | {"."})
    vocab = {token: i for i, token in enumerate(["[UNK]", EOS] + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token=EOS, pad_token=EOS)


def group_texts(examples: dict[str, list[list[int]]], block_size: int) -> dict[str, list[list[int]]]:
    """run_clm.py's ``group_texts``: concatenate the tokenized texts and cut them into blocks of ``block_size``."""
    concatenated = {k: list(chain(*examples[k])) for k in examples}
    total_length = len(concatenated[list(examples.keys())[0]])
    if total_length < block_size:
        raise ValueError(f"block_size of {block_size} is too big - use a value <={total_length}")
    total_length = (total_length // block_size) * block_size
    result = {k: [t[i: i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated.items()}
    result["labels"] = [list(block) for block in result["input_ids"]]
    return result


def to_rows(columns: dict[str, list[list[int]]]) -> list[dict[str, list[int]]]:
    """Column lists as a list of samples (what a ``datasets.Dataset`` yields), for ``default_data_collator``."""
    names = list(columns)
    return [dict(zip(names, values)) for values in zip(*(columns[name] for name in names))]


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=DEFAULTS + sys.argv[1:])
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)], level=logging.INFO)
    transformers.utils.logging.set_verbosity_warning()
    set_seed(training_args.seed)  # the same initial weights on every process and at every launch

    texts = generate_corpus(data_args.corpus_lines, data_args.corpus_seed)
    held_out = len(texts) * data_args.validation_split_percentage // 100
    raw_datasets = {"validation": texts[:held_out], "train": texts[held_out:]}
    tokenizer = build_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=data_args.block_size, n_embd=model_args.n_embd,
                        n_layer=model_args.n_layer, n_head=model_args.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config)
    n_params = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    logger.info(f"Training new model from scratch - Total size={n_params / 2**20:.2f}M params")

    lm_datasets = {}
    for split, lines in raw_datasets.items():
        tokenized = tokenizer(lines)
        columns = {name: tokenized[name] for name in ("input_ids", "attention_mask")}
        lm_datasets[split] = to_rows(group_texts(columns, data_args.block_size))
    train_dataset = lm_datasets["train"]
    if data_args.max_train_samples is not None:
        train_dataset = train_dataset[:data_args.max_train_samples]
    eval_dataset = lm_datasets["validation"]
    if data_args.max_eval_samples is not None:
        eval_dataset = eval_dataset[:data_args.max_eval_samples]

    def preprocess_logits_for_metrics(logits, labels):
        if isinstance(logits, tuple):
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        labels = labels[:, 1:].reshape(-1)  # the predictions of the next token
        preds = preds[:, :-1].reshape(-1)
        return {"accuracy": float(np.mean(preds == labels))}

    trainer = AdaptiveTrainer(  # adaptive: was `Trainer(`
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        compute_metrics=compute_metrics if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
    )

    if training_args.do_train:
        checkpoint = None
        if training_args.resume_from_checkpoint is not None:
            checkpoint = training_args.resume_from_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()  # saves the tokenizer too
        metrics = train_result.metrics
        max_train_samples = data_args.max_train_samples if data_args.max_train_samples is not None \
            else len(train_dataset)
        metrics["train_samples"] = min(max_train_samples, len(train_dataset))
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            perplexity = math.exp(metrics["eval_loss"])
        except OverflowError:
            perplexity = float("inf")
        metrics["perplexity"] = perplexity
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        if trainer.is_world_process_zero():
            print(f"final eval loss {metrics['eval_loss']:.6f} after {trainer.state.global_step} steps on "
                  f"{trainer.args.world_size} processes", flush=True)


if __name__ == "__main__":
    main()
