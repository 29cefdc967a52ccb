"""The `ppo-logprobs` command: serve | score | bench."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

from ppo_logprobs.workers.outputs import OUTPUTS


def _write(stream, text: str) -> None:
    stream.write(text)
    stream.flush()


class _Progress:
    """A counter on stderr: redrawn in place on a terminal; elsewhere (a log file, a pipe) a line of its own for the
    first and the last count and at most one every `every` seconds between (not one line of every count joined)."""

    def __init__(self, every: float = 10.0) -> None:
        self.tty, self.every, self.shown = sys.stderr.isatty(), every, None

    def __call__(self, text: str, last: bool = False) -> None:
        if self.tty or last or self.shown is None or time.monotonic() - self.shown >= self.every:
            _write(sys.stderr, "\r" + text if self.tty else text + "\n")
            self.shown = time.monotonic()

    def end(self) -> str:
        """What ends the counter's line before other text: a newline on a terminal once it drew, else nothing."""
        return "\n" if self.tty and self.shown is not None else ""


def _completed_lines(path: str) -> int:
    """Lines already written to `path`; a partial last line (a run killed mid-write) is cut off."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            f.truncate(keep)
    return data[:keep].count(b"\n")


def _read_input(path: str) -> list[dict]:
    """The file's rows, each with its line number; a line that is not a JSON object with input_ids stops the
    command, naming the line (the values themselves are checked against the model by _check)."""
    rows = []
    try:
        f = open(path)
    except OSError as e:
        raise SystemExit(f"{path}: cannot read it ({e.strerror})") from None
    with f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise SystemExit(f"{path}:{number}: not JSON ({e})") from None
            if not isinstance(row, dict) or "input_ids" not in row:
                raise SystemExit(f"{path}:{number}: expected a JSON object with 'input_ids'")
            rows.append({"input_ids": row["input_ids"], "score_from": row.get("score_from", 1), "line": number})
    return rows


_INDEXED = re.compile(r"^(\w+)\[(\d+)\]")  # a contract message starts with the field and the sequence's index


def _check(rows: list[dict], path: str, vocab_size: int, max_length: int, temperature: float) -> None:
    """Every row against the model, once, before anything is sent: the first bad value stops the command, named by
    its line in the file (the same checks the service runs)."""
    from ppo_logprobs.workers.errors import RequestError
    from ppo_logprobs.workers.request import ScoreRequest

    if not rows:
        return
    try:
        ScoreRequest.build([r["input_ids"] for r in rows], [r["score_from"] for r in rows], temperature,
                           vocab_size=vocab_size, max_length=max_length)
    except RequestError as e:
        message = str(e)
        if (found := _INDEXED.match(message)) is None:
            raise SystemExit(f"{path}: {message}") from None
        index = int(found.group(2))
        message = found.group(1) + message[found.end():].replace(f"input_ids[{index}]", "input_ids")
        line = rows[index]["line"]
        raise SystemExit(f"{path}:{line}: {message}") from None


def _client(kind: type, args: argparse.Namespace):
    """A client of kind `kind` for --url, with the key from --api-key-file or PPO_LOGPROBS_API_KEY (never a flag: a
    command line shows in `ps`); a file it cannot read, or a URL or key the client cannot use, stops the command."""
    key = os.environ.get("PPO_LOGPROBS_API_KEY")
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) else "not text"
            raise SystemExit(f"--api-key-file {args.api_key_file}: cannot read it ({reason})") from None
    try:
        return kind(args.url, api_key=key or None)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _served(models: list, args: argparse.Namespace):
    """The info of the served model --model names (default: the first served)."""
    info = next((m for m in models if m.name == args.model), None if args.model else models[0])
    if info is None:
        raise SystemExit(f"{args.url} serves no model {args.model!r} (it serves {[m.name for m in models]})")
    return info


def score(args: argparse.Namespace) -> None:
    from .log_prob_client import LogProbClient, LogProbError

    rows = _read_input(args.input)
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        raise SystemExit(f"--output {args.output}: no directory {folder!r}")
    done = _completed_lines(args.output)
    if done > len(rows):
        raise SystemExit(f"{args.output} has {done} lines but {args.input} only {len(rows)}: not its output")
    with _client(LogProbClient, args) as client:
        try:
            info = _served(client.models(), args)
        except LogProbError as e:
            raise SystemExit(f"{args.url}: {e.detail}") from None
        _check(rows[done:], args.input, info.vocab_size, info.max_length, args.temperature)
        total_tokens = sum(len(r["input_ids"]) for r in rows[done:])
        tokens, start, progress = 0, time.perf_counter(), _Progress()
        with open(args.output, "a") as out:
            for lo in range(done, len(rows), args.batch_sequences):
                batch = rows[lo : lo + args.batch_sequences]
                try:
                    results = client.score([r["input_ids"] for r in batch], [r["score_from"] for r in batch],
                                           temperature=args.temperature, model=info.name,
                                           return_entropy=not args.no_entropy, top_k=args.top_k)
                except LogProbError as e:
                    lines = f"{batch[0]['line']}-{batch[-1]['line']}"
                    raise SystemExit(f"{progress.end()}{args.input}:{lines}: the service refused these lines: {e}"
                                     ) from None
                for i, r in enumerate(results, lo):
                    line = {"index": i, "log_probs": r.log_probs.tolist(), "weights_version": r.weights_version}
                    if r.entropy is not None:
                        line["entropy"] = r.entropy.tolist()
                    # the per-token outputs asked for (top_k): a tail of -inf, no token outside the top k, as null
                    line.update({name: OUTPUTS[name].to_json(values) for name, values in r.extras.items()})
                    out.write(json.dumps(line) + "\n")
                out.flush()
                tokens += sum(len(r["input_ids"]) for r in batch)
                rate = tokens / max(time.perf_counter() - start, 1e-9)
                progress(f"{lo + len(batch)}/{len(rows)} sequences, {tokens}/{total_tokens} tokens, "
                         f"{rate:,.0f} tokens/s", last=lo + len(batch) == len(rows))
    _write(sys.stderr, f"{progress.end()}wrote {args.output} ({len(rows) - done} new lines, {done} kept from before)\n")


def bench(args: argparse.Namespace) -> None:
    from .log_prob_client import AsyncLogProbClient, LogProbError

    async def run() -> dict:
        async with _client(AsyncLogProbClient, args) as client:
            info = _served(await client.models(), args)
            g = np.random.default_rng(0)
            requests = [[g.integers(0, info.vocab_size, g.integers(args.min_len, args.max_len + 1)).tolist()
                         for _ in range(args.sequences)] for _ in range(args.requests)]
            await client.score(requests[0], model=info.name)  # warm-up
            sem = asyncio.Semaphore(args.clients)
            done = 0

            async def one(r):
                nonlocal done
                async with sem:
                    await client.score(r, model=info.name)
                done += 1
                progress(f"{done}/{args.requests} requests", last=done == args.requests)

            start = time.perf_counter()
            await asyncio.gather(*(one(r) for r in requests))
            seconds = time.perf_counter() - start
            tokens = sum(len(s) for r in requests for s in r)
            return dict(model=info.name, requests=args.requests, clients=args.clients, tokens=tokens,
                        seconds=seconds, requests_per_s=args.requests / seconds, tokens_per_s=tokens / seconds,
                        retries=client.retries)

    if args.min_len > args.max_len:
        raise SystemExit(f"--min-len {args.min_len} is above --max-len {args.max_len}")
    progress = _Progress()
    try:
        figures = asyncio.run(run())
    except LogProbError as e:
        raise SystemExit(f"{progress.end()}{args.url}: {e.detail}") from None
    _write(sys.stderr, progress.end())
    _write(sys.stdout, json.dumps(figures) + "\n")


class _Defaults(argparse.HelpFormatter):
    """--help gives each option's default, unless it has none or its help names it already."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ppo-logprobs", description="Per-token log-probs and entropies for PPO.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="start the gateway and its workers (flags: serve --help)", add_help=False)

    # (no abbreviated flags: `--api-key K` would be taken as --api-key-file)
    shown = _Defaults
    p = sub.add_parser("score", help="score a JSONL file of sequences through a running service", allow_abbrev=False,
                       formatter_class=shown)
    p.add_argument("input", help='JSONL, one {"input_ids": [...], "score_from": k} per line (score_from optional)')
    p.add_argument("-o", "--output", required=True, help="JSONL results, one per input line; resumed if present")
    p.add_argument("--model", help="served model name (default: the service's first)")
    p.add_argument("--temperature", type=float, default=1.0, help="the logits are divided by it")
    p.add_argument("--no-entropy", action="store_true", help="leave the entropies out of the results")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="also each entry's K most likely tokens (top_log_probs, top_ids) and the tail's log-prob")
    p.add_argument("--batch-sequences", type=int, default=256, help="sequences per call (and per flush)")

    b = sub.add_parser("bench", help="throughput of a running service: random requests from concurrent clients",
                       allow_abbrev=False, formatter_class=shown)
    b.add_argument("--model", help="served model name (default: the service's first)")
    b.add_argument("--requests", type=int, default=200, help="requests in all")
    b.add_argument("--clients", type=int, default=16, help="requests in flight at once")
    b.add_argument("--sequences", type=int, default=4, help="sequences per request")
    b.add_argument("--min-len", type=int, default=64, help="tokens of the shortest sequence")
    b.add_argument("--max-len", type=int, default=512, help="tokens of the longest sequence")
    for q in (p, b):
        q.add_argument("--url", default=os.environ.get("PPO_LOGPROBS_URL", "http://127.0.0.1:8000"),
                       help="the service (or $PPO_LOGPROBS_URL)")
        q.add_argument("--api-key-file", help="a file holding the service's API key (default: $PPO_LOGPROBS_API_KEY)")

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the service's own command line, in this process (the client imports no service)
        os.execv(sys.executable, [sys.executable, "-m", "ppo_logprobs.service", *argv[1:]])
    args = parser.parse_args(argv)
    for flag in ("batch_sequences", "requests", "clients", "sequences", "min_len"):
        if getattr(args, flag, 1) < 1:
            parser.exit(2, f"--{flag.replace('_', '-')} {getattr(args, flag)}: give 1 or more\n")
    try:
        {"score": score, "bench": bench}[args.command](args)
    except SystemExit as e:  # a mistake (the command's, the input's, the service's answer), said in one line
        if isinstance(e.code, str):
            parser.exit(2, e.code + "\n")
        raise


if __name__ == "__main__":
    main()
