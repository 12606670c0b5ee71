"""Record llama.cpp's tokenization of the embedded GGUF as a test fixture.

agentkv rebuilds a Hugging Face tokenizer from the GGUF's own vocabulary and
merges; tests/model/test_gguf.py checks it against what llama.cpp (the GGUF's
reference implementation) makes of the same file. llama-cpp-python takes ~5
minutes to compile, so it is not a test dependency: this script was run once,
in a separate venv (pip install llama-cpp-python), and its output committed:

    python tests/scripts/record_llama_cpp_tokens.py GGUF > tests/data/llama_cpp_tokens.json
"""

import json
import sys

import llama_cpp

SAMPLES = [
    "What is the capital of France?",
    "Prices: 12345 items at 3.50 each, 2024-11-22.",
    "naïve café – “quotes” 🙂 and 中文 text",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces\n\n\ttabs and\r\nwindows newlines   ",
    "def f(x):\n    return x ** 2  # comment",
    "Ünïcödé, ÆØÅ, ελληνικά, русский, العربية, עברית, 日本語のテキスト",
    "x = {'a': [1, 2.5e-3, None]}\t# tabs\tand 'quotes' it's we'll they're",
    "   \n\n\n    multiple     spaces and\u00a0no-break\u2009thin spaces",
    "<|endoftext|>special tokens <|im_end|> inline<|im_start|>",
    "1234567890 0.000001 -42 +7 1e10 3,141,592",
    "emoji 👩‍💻🚀✨ and combining e\u0301 marks",
]


def main(path: str) -> None:
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    records = [
        {"text": text, "ids": llm.tokenize(text.encode(), add_bos=False, special=True)}
        for text in SAMPLES
    ]
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    source = json.dumps("llama-cpp-python " + llama_cpp.__version__)
    print('{"source": ' + source + ', "samples": [\n' + ",\n".join(lines) + "\n]}")


if __name__ == "__main__":
    main(sys.argv[1])
