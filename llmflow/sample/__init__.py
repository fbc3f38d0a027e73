"""``llmflow sample``: built-in sample assets, generated offline from a seed.

Everything the demo and the tests need, in the formats the real assets come in:

- ``tokenizer/``: a byte-level BPE trained on the generated text, with Qwen2.5-Instruct's
  special tokens, ``tokenizer_config.json`` and chat template;
- ``model/``: a tiny Qwen2-style model with random weights (config.json, model.safetensors,
  generation_config.json and the tokenizer files);
- ``pretrain/corpus.parquet``: articles in the layout of the Wikipedia dumps on the Hub
  (id, url, title, text);
- ``instruct/alpaca.parquet`` and ``.jsonl``: an Alpaca-layout instruction set
  (instruction, input, output);
- ``preference/preference_{train,heldout}.{parquet,jsonl}``: preference pairs in TRL's
  pairwise text layout (prompt, chosen, rejected): questions about the facts, the true
  statement chosen, a false one of the same form rejected; the held-out pairs ask the same
  facts in other wordings (``preferences.py``);
- ``mmlu/hf/{subject}/{dev,test}-00000-of-00001.parquet`` (the ``cais/mmlu`` layout) and
  ``mmlu/csv/data/{dev,test}/{subject}_{split}.csv`` (the original MMLU CSV layout);
- ``boolq/`` and ``agieval/``: BoolQ and two AGIEval tasks in their Hub layouts
  (``choice_tasks.py``);
- ``gsm8k/`` and ``bbh/``: GSM8K word problems and two BBH subtasks in their Hub layouts
  (``generative_tasks.py``);
- ``minerva-math500/`` and ``minerva-math/``: MATH-500 and MATH problems about the countries
  (``math_tasks.py``);
- ``mmlu-pro/`` and ``gpqa-diamond/``: MMLU-Pro questions of three categories and GPQA
  Diamond questions about the countries, in their Hub layouts (``reasoning_choice_tasks.py``);
- ``ifeval/``: IFEval prompts about the countries covering its 25 instruction types
  (``ifeval_tasks.py``).

All the text describes one generated world of made-up countries (capitals, national
animals, flag colours) plus small sums, so the assets fit together: pretraining on the
corpus or finetuning on the instruction set teaches the facts the MMLU questions ask about.
The instruction set holds plain questions (answered in a sentence) and practice quizzes in
the MMLU prompt format; the test split asks about the same facts, each question with other
distractors than any practice question, and dev and test ask about different facts.

Every answer has a fixed choice position (its slot: capitals and countries are dealt into
four slots, animals and colours too, and a sum goes to the slot of its remainder mod 4),
while the other three choices vary. A model that knows a fact therefore knows its letter
without matching the answer's text against the choices, a skill that a model of a few
million parameters does not learn in the few hundred steps a CPU demo can afford; a model
that does not know the fact still scores chance (25%), the letters being balanced.

The same seed gives byte-identical files. One module per asset (``world.py`` holds the
world and its facts); ``assets.py`` writes them all, its manifest last.
"""

