"""The README's "Start from a Hugging Face model" command block, read from README.md and run with
its variables set for a toy model: shared by the CPU test tests/unit/convert/test_readme_finetune.py and
the GPU test of tests/functional/test_convert_hf_finetune.py, so that both run the commands the
README shows, not a copy of them.

The block is run by bash, as a user runs it, in a working directory of its own (the block's
relative paths, ``ckpt/...`` and ``data/...``, land there; ``tools`` and ``pretrain_gpt.py`` are
links to this repository's). ``python`` is this interpreter; ``torchrun`` either launches for
real (the GPU test) or only records its arguments (the CPU test, which then parses and plans
them as pretrain_gpt.py does).

The toy model is a Qwen3-MoE of tests/converted_finetune.py's toy widths made with
transformers' own class (random weights), saved with a byte-level BPE tokenizer trained on a
toy corpus by tools/preprocess_data.py's own trainer: like the released model's directory, it
holds a tokenizer, so the import writes the tokenizer's flags into pretrain_args.txt and the
README's preprocessing command tokenizes the corpus with it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
SECTION = "Start from a Hugging Face model"
# the variables the block starts with, which the user sets
VARIABLES = ("HF_DIR", "DATA", "GPUS", "TRAIN_ITERS")
# what the toy runs take instead of the README's values (DATA stays as written: the README's own
# preprocessing command makes it)
TOY_GPUS = "1"
TOKENIZER_VOCAB = 512  # byte-level BPE: the 256 bytes, the end of text and merges
CORPUS_DOCUMENTS = 200
_VARIABLE = re.compile(r"^([A-Z][A-Z0-9_]*)=(\S*)(?:\s+#.*)?$")
_FENCE = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`([^`\n]+)`")

# bash functions that stand in for the programs the block names
PYTHON_FUNCTION = f'python() {{ {shlex.quote(sys.executable)} "$@"; }}'
LAUNCHING_TORCHRUN = 'torchrun() { python -m torch.distributed.run "$@"; }'
# the arguments, NUL-separated, into the file $TORCHRUN_RECORD
RECORDING_TORCHRUN = 'torchrun() { printf "%s\\0" "$@" > "$TORCHRUN_RECORD"; }'


@dataclass
class Block:
    """The README's block: its variables (name -> the line as written) and its commands, each on
    one line (continuation lines joined), in order; ``preprocess``: the
    ``tools/preprocess_data.py`` command the section's text gives for ``DATA``."""

    variables: dict
    commands: list
    preprocess: str

    def value(self, name: str) -> str:
        """The value the README gives ``name``."""
        return _VARIABLE.match(self.variables[name]).group(2)

    def converting(self, subcommand: str) -> str:
        """The one ``tools/convert_hf.py SUBCOMMAND`` command."""
        return self._one(lambda words: words[1:3] == ["tools/convert_hf.py", subcommand],
                         f"tools/convert_hf.py {subcommand}")

    def launch(self) -> str:
        """The one ``torchrun ... pretrain_gpt.py`` command."""
        return self._one(lambda words: "torchrun" in words, "torchrun")

    def _one(self, matches, what: str) -> str:
        found = [command for command in self.commands if matches(words(command))]
        assert len(found) == 1, f"README's block has {len(found)} `{what}` commands: {found}"
        return found[0]


def words(command: str) -> list:
    """The command's words as written (variables and ``$(...)`` not expanded)."""
    return shlex.split(command, comments=True)


def option(command: str, flag: str) -> str:
    """The value of ``flag`` in ``command`` as written."""
    found = words(command)
    assert flag in found, f"README's command has no {flag}: {command}"
    return found[found.index(flag) + 1]


def environment_of(command: str) -> dict:
    """The ``NAME=value`` assignments in front of the command."""
    assignments = {}
    for word in words(command):
        name, equals, value = word.partition("=")
        if not equals or not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
            break
        assignments[name] = value
    return assignments


def section_text(readme: str) -> str:
    start = readme.index(f"\n## {SECTION}\n")
    end = readme.find("\n## ", start + 1)
    return readme[start:end if end >= 0 else len(readme)]


def read_block(readme: str | None = None) -> Block:
    """The block of README.md (or of the text ``readme``)."""
    section = section_text(README.read_text(encoding="utf-8") if readme is None else readme)
    fence = _FENCE.search(section)
    assert fence, f"README's section {SECTION!r} has no bash block"
    variables, commands = {}, []
    for line in fence.group(1).replace("\\\n", " ").splitlines():
        line = " ".join(line.split())
        if not line or line.startswith("#"):
            continue
        variable = _VARIABLE.match(line)
        if variable and not commands:
            variables[variable.group(1)] = line
        else:
            commands.append(line)
    preprocess = [span for span in _CODE_SPAN.findall(section[fence.end():])
                  if "tools/preprocess_data.py" in span]
    assert len(preprocess) == 1, f"README's section names tools/preprocess_data.py {preprocess}"
    return Block(variables, commands, preprocess[0])


def script(block: Block, values: dict, commands: list, torchrun: str) -> str:
    """A bash script of the block's variables (those of ``values`` set to them, the others as
    written) and ``commands``, with ``python`` and ``torchrun`` defined as functions."""
    lines = ["set -euo pipefail", PYTHON_FUNCTION, torchrun]
    lines += [f"{name}={shlex.quote(str(values[name]))}" if name in values else line
              for name, line in block.variables.items()]
    return "\n".join(lines + list(commands)) + "\n"


def working_directory(directory: Path) -> Path:
    """``directory`` with links to this repository's ``tools`` and ``pretrain_gpt.py``, where the
    block's relative paths land."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tools", "pretrain_gpt.py"):
        (directory / name).symlink_to(REPO_ROOT / name)
    return directory


def run_script(text: str, directory: Path, log: Path, timeout_s: float,
               environment: dict | None = None) -> subprocess.CompletedProcess:
    """Run the bash script ``text`` in ``directory``; everything it prints goes to ``log``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])), **(environment or {}))
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)  # the block sets what it needs
    with open(log, "w") as output:
        done = subprocess.run(["bash", "-c", text], cwd=directory, env=env, stdout=output,
                              stderr=subprocess.STDOUT, timeout=timeout_s)
    assert done.returncode == 0, (f"README's commands exited {done.returncode}:\n{text}\n"
                                  f"{log.read_text()[-4000:]}")
    return done


def write_corpus(path: Path, documents: int = CORPUS_DOCUMENTS) -> Path:
    """A JSONL corpus of ``documents`` texts of random words (the same every time)."""
    generator = random.Random(0)
    vocabulary = [f"{a}{b}{c}" for a in "bcdfgklmnprst" for b in "aeiou" for c in "nrst"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as corpus:
        for _ in range(documents):
            text = " ".join(generator.choice(vocabulary) for _ in range(generator.randint(50, 300)))
            corpus.write(json.dumps({"text": text}) + "\n")
    return path


def make_toy_model(directory: Path, corpus: Path) -> Path:
    """A toy Qwen3-MoE saved by transformers into ``directory``, with a tokenizer trained on
    ``corpus``."""
    from tests.converted_finetune import TOY_WIDTHS, save_model
    from megatron.bounded.launch.commands.preprocess_data import train_tokenizer

    save_model("qwen3_moe", directory, **TOY_WIDTHS["qwen3_moe"])
    train_tokenizer(str(corpus), ["text"], TOKENIZER_VOCAB, str(directory))
    return directory


def prepare_toy_run(root: Path) -> tuple:
    """(the block, its working directory, the toy model's directory) under ``root``: the toy
    model with its tokenizer, and the README's ``DATA`` made by the README's own preprocessing
    command from a toy corpus."""
    block = read_block()
    directory = working_directory(root / "work")
    corpus = write_corpus(directory / option(block.preprocess, "--input"))
    hf_dir = make_toy_model(root / "toy_qwen3_moe", corpus)
    run_script(script(block, {"HF_DIR": hf_dir}, [block.preprocess], RECORDING_TORCHRUN),
               directory, root / "preprocess.log", timeout_s=300)
    return block, directory, hf_dir


def recorded_launch(record: Path) -> tuple:
    """(GPUs per node, pretrain_gpt.py's flags) of the arguments a recording torchrun saved."""
    arguments = record.read_text().split("\0")[:-1]
    scripts = [i for i, word in enumerate(arguments) if word.endswith("pretrain_gpt.py")]
    assert scripts, f"torchrun runs no pretrain_gpt.py: {arguments}"
    launcher, flags = arguments[:scripts[0]], arguments[scripts[0] + 1:]
    for name in ("--nproc-per-node", "--nproc_per_node"):
        if name in launcher:
            return int(launcher[launcher.index(name) + 1]), flags
    raise AssertionError(f"torchrun is not given --nproc-per-node: {launcher}")
