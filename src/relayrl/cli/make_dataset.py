"""`relayrl make-dataset`: the example tasks' JSONL datasets (relayrl.tasks)."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "make-dataset"
HELP = "write the demo task's JSONL dataset"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("examples/data/arithmetic.jsonl"))
    p.add_argument("--max-operand", type=int, default=9)
    p.add_argument("--max-sum", type=int, default=9, help="keep only rows with a + b <= this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--task",
        choices=("addition", "chat-addition", "calculator", "lookup"),
        default="addition",
        help="chat-addition: two-digit sums as conversations (messages) with a held-out split; "
        "calculator: products of two digits with two-digit results for the multi-turn tool "
        "example (calculator_tools.yaml); lookup: the tens digits of products of two two-digit "
        "numbers for the argument-free tool example (lookup_tools.yaml)",
    )
    p.add_argument(
        "--heldout-out",
        type=Path,
        default=Path("examples/data/chat_addition_heldout.jsonl"),
        help="chat-addition: where the held-out split goes",
    )
    p.add_argument("--heldout-rows", type=int, default=200, help="chat-addition: held-out questions")


def run(args: argparse.Namespace) -> int:
    if args.task in ("calculator", "lookup"):
        from relayrl.tasks import calculator, lookup

        n = (lookup if args.task == "lookup" else calculator).make_dataset(args.out, seed=args.seed)
        print(f"wrote {n} rows to {args.out}")
        return 0
    if args.task == "chat-addition":
        from relayrl.tasks.chat_addition import make_chat_dataset

        train, held = make_chat_dataset(args.out, args.heldout_out, args.heldout_rows, args.seed)
        print(f"wrote {train} rows to {args.out} and {held} held-out rows to {args.heldout_out}")
        return 0
    from relayrl.tasks.arithmetic import make_dataset

    n = make_dataset(args.out, args.max_operand, args.seed, args.max_sum)
    print(f"wrote {n} rows to {args.out}")
    return 0
