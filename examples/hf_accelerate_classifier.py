"""A Hugging Face Accelerate script made elastic: a tiny BERT classifier on generated token sequences.

Written as transformers' ``run_glue_no_trainer.py`` is (per-process batch
sizes, ``prepare``, ``accumulate``, ``get_scheduler``, ``gather_for_metrics``,
``--max-train-steps`` counted in ``completed_steps``, ``save_state``), with
the lines that change marked ``# adaptive:``.  The model is random-init and
the data generated: nothing is downloaded.

    pip install -e ".[huggingface]"
    python examples/hf_accelerate_classifier.py
    adaptive-run --standalone --nproc-per-node=2 examples/hf_accelerate_classifier.py

Stop it (Ctrl-C, SIGTERM, kill a worker) and run the same command again
with any number of processes: it resumes at the exact sample, with the
global batch of its first launch.  See docs/huggingface.md.
"""

import argparse
import logging
import math

import torch

try:
    import transformers
    from adaptive.integrations.accelerate import AdaptiveAccelerator  # adaptive: was `from accelerate import ...`
except ImportError as error:
    raise SystemExit(f'this example needs transformers and accelerate ({error}): pip install "adaptive-elastic'
                     '[huggingface]" (in a checkout: pip install -e ".[huggingface]")') from None

import adaptive

log = logging.getLogger("hf_accelerate_classifier")

VOCAB, LENGTH = 64, 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-train-epochs", type=int, default=3)
    parser.add_argument("--max-train-steps", type=int, default=0, help="stop after this many optimizer steps")
    parser.add_argument("--per-device-train-batch-size", type=int, default=16)
    parser.add_argument("--per-device-eval-batch-size", type=int, default=32)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--num-warmup-steps", type=int, default=10)
    parser.add_argument("--train-samples", type=int, default=1536)
    parser.add_argument("--checkpointing-steps", type=int, default=0,
                        help="also accelerator.save_state(--output-dir) every this many steps (0: never)")
    parser.add_argument("--output-dir", default="hf_accelerate_classifier_out")
    return parser.parse_args()


def make_dataset(samples: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Class 1 sequences draw most tokens from the upper half of the vocabulary, class 0 from the lower."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (samples,), generator=generator)
    tokens = torch.randint(1, VOCAB // 2, (samples, LENGTH), generator=generator)
    flip = torch.rand(samples, LENGTH, generator=generator) < 0.7
    tokens = torch.where(flip & (labels[:, None] == 1), tokens + VOCAB // 2 - 1, tokens)
    return [{"input_ids": tokens[i], "labels": labels[i]} for i in range(samples)]


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    accelerator = AdaptiveAccelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)  # adaptive
    torch.manual_seed(0)  # the same initial weights on every process and every launch
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=LENGTH, num_labels=2)
    model = transformers.BertForSequenceClassification(config)
    train_dataloader = torch.utils.data.DataLoader(make_dataset(args.train_samples, 1), shuffle=True,
                                                   batch_size=args.per_device_train_batch_size)
    eval_dataloader = torch.utils.data.DataLoader(make_dataset(256, 2), batch_size=args.per_device_eval_batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    # adaptive: the global batch is the first launch's at any world size, and a prepared scheduler steps once per
    # process of the first launch (scheduler_steps_per_update): transformers' scripts use num_processes for both
    processes = accelerator.scheduler_steps_per_update
    global_batch = args.per_device_train_batch_size * processes * args.gradient_accumulation_steps
    steps_per_epoch = math.ceil(len(train_dataloader.dataset) / global_batch)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    lr_scheduler = transformers.get_scheduler("linear", optimizer=optimizer,
                                              num_warmup_steps=args.num_warmup_steps * processes,
                                              num_training_steps=max_train_steps * processes)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    completed_steps = accelerator.completed_steps  # adaptive: restored on a relaunch (was 0, or parsed from a path)
    # adaptive: no --resume-from-checkpoint, no skip_first_batches, no starting-epoch arithmetic
    for epoch in adaptive.remaining_epochs_until(args.num_train_epochs):  # adaptive: was range(...)
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                if args.checkpointing_steps and completed_steps % args.checkpointing_steps == 0:
                    accelerator.save_state(args.output_dir)
            if completed_steps >= max_train_steps:
                break
        model.eval()
        correct = total = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                predictions = model(**batch).logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += int((predictions == references).sum())
            total += len(references)
        if accelerator.is_main_process:
            log.info("epoch %d: accuracy %.1f%% on %d evaluation samples; %d optimizer steps, %d samples, lr %.2e, "
                     "%d processes", epoch, 100 * correct / max(total, 1), total, accelerator.completed_steps,
                     accelerator.samples_seen, lr_scheduler.get_last_lr()[0], accelerator.num_processes)
        if completed_steps >= max_train_steps:
            adaptive.finish_training()  # adaptive: checkpointed as finished, so that a relaunch trains nothing
            break
    if accelerator.is_main_process:
        log.info("done: %d optimizer steps, %d samples", accelerator.completed_steps, accelerator.samples_seen)


if __name__ == "__main__":
    main()
