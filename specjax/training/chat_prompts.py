"""Training prompts in the style of a chat assistant's users, made offline.

``synth_prompts`` asks short one-line questions.  Real users of a chat model write longer requests: a
deliverable with an audience and several constraints, a persona to keep, a question in several parts, a bug
to find, or a task over a text they paste in (summarize it, translate it, pull facts out of it).  A drafter
trained only on the short questions predicts the replies to those poorly, so this module makes requests of
those shapes from its own word lists (nothing from a benchmark):

  ``chat_requests(n, seed)``            multi-constraint writing, personas, multi-part questions, code review,
                                        multi-step word problems
  ``passage_requests(passages, n, seed)``  tasks over texts the project already has (the target's own replies:
                                        ``data.prepare`` passes them in), so no outside text is needed

Both are deterministic in ``seed`` and return distinct ``{"id", "category", "prompt"}`` records.
"""
from __future__ import annotations

import random
import re
from typing import Sequence

from specjax.training.synth_prompts import LANGUAGES, PEOPLE, PLACES, _all_topics, distinct_records

FORMS = ["a blog post", "an email", "a short story", "a speech", "a product description", "a cover letter",
         "a lesson plan", "a news article", "a poem", "a dialogue", "a social media post", "an FAQ page",
         "a travel itinerary", "a review", "a persuasive essay", "a project proposal", "a press release",
         "a letter to the editor", "a how-to guide", "a newsletter", "a podcast script", "a job advertisement",
         "a motivational message", "a short report", "a set of interview questions"]

VERBS = ["Write", "Draft", "Compose", "Create", "Prepare"]

AUDIENCES = ["for high-school students", "for busy parents", "for a technical audience", "for complete "
             "beginners", "for my manager", "for a group of retirees", "for children aged 8 to 10",
             "for potential investors", "for a local newspaper", "for new employees", "for a university "
             "admissions office", "for my neighbours", "for a science club", "for tourists"]

CONSTRAINTS = ["Keep it under 150 words.", "Use exactly three paragraphs.", "Give it a catchy title.",
               "Use bullet points for the main ideas.", "End with a question to the reader.",
               "Write in a formal tone.", "Make it light-hearted and funny.", "Mention at least two concrete "
               "examples.", "Avoid technical jargon.", "Include a short summary at the end.",
               "Address the reader directly.", "Include one surprising statistic.",
               "Keep the sentences short.", "Start with a personal anecdote.", "Add a clear call to action.",
               "Organize it under headings.", "Make it suitable to read aloud in two minutes.",
               "Compare at least two options.", "Do not use the word 'very'.", "Finish with a short rhyme."]

OPENERS = ["", "", "", "I need your help. ", "Quick request: ", "I'm preparing something for work. ",
           "My teacher asked me to do this and I'm stuck. ", "Could you help me with this? ",
           "I'm {p} and ", "Hi! "]

CHARACTERS = ["a pirate captain", "a medieval knight", "a famous detective", "a sports commentator",
              "a stand-up comedian", "a strict fitness coach", "a wise old wizard", "a time traveller from "
              "the year 3000", "a cheerful kindergarten teacher", "a grumpy cat", "a Shakespearean actor",
              "a robot learning about humans", "a 1920s newspaper reporter", "an enthusiastic tour guide",
              "a calm airline pilot", "a famous chef"]

CHARACTER_QUESTIONS = ["What do you think about {t}?", "How should I spend my weekend?",
                       "What is the secret to a happy life?", "Can you explain {t} to me?",
                       "Give me advice about {t}.", "Tell me about your greatest adventure.",
                       "What would you change about the modern world?", "How do you deal with stress?",
                       "Describe your favourite place.", "Convince me to try {t}."]

MULTI_PART = ["Explain {t}. Then describe how it relates to {u}, and give one real-world example.",
              "What are the main causes and consequences of {t}? Discuss at least three of each.",
              "Describe {t} and evaluate its impact on {u}. Conclude with your own view.",
              "As {p}, how would you use {t} in your work? Give three specific ideas and one risk.",
              "First define {t} in one sentence. Then list its advantages and disadvantages, and finally "
              "suggest how it might change in the next twenty years.",
              "Imagine you have to teach {t} in a single lesson. What would you cover, in what order, and "
              "how would you check that students understood?",
              "What would happen if {t} suddenly disappeared? Consider the effects on people, on the economy "
              "and on nature.", "Give a balanced argument for and against {t}, then say which side you find "
              "stronger and why.",
              "Explain the difference between {t} and {u}, and describe a situation where each matters more.",
              "Write three questions an expert in {t} might ask, and answer each in two or three sentences."]

BUGGY_CODE = [
    ("Python", "def average(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs) + 1"),
    ("Python", "def is_even(n):\n    return n % 2 == 1"),
    ("Python", "def last_item(items):\n    return items[len(items)]"),
    ("Python", "def count_words(text):\n    counts = {}\n    for w in text.split():\n        counts[w] = 1\n"
               "    return counts"),
    ("JavaScript", "function sum(arr) {\n  let s = 0;\n  for (let i = 0; i <= arr.length; i++) s += arr[i];\n"
                   "  return s;\n}"),
    ("JavaScript", "function max(a, b) {\n  if (a > b) return b;\n  return a;\n}"),
    ("C", "int factorial(int n) {\n    int r = 0;\n    for (int i = 1; i <= n; i++) r *= i;\n    return r;\n}"),
    ("Java", "int indexOf(int[] a, int x) {\n    for (int i = 1; i < a.length; i++)\n        if (a[i] == x) "
             "return i;\n    return -1;\n}"),
    ("SQL", "SELECT name, COUNT(*) FROM orders WHERE COUNT(*) > 5 GROUP BY name;"),
    ("Python", "def reverse(s):\n    out = ''\n    for ch in s:\n        out = out + ch\n    return out"),
]

CODE_ASKS = ["Find the bug in this {lang} code and fix it:\n\n{code}",
             "This {lang} code does not do what its name says. What is wrong?\n\n{code}",
             "Review the following {lang} code, explain the problem and give a corrected version.\n\n{code}"]

CODE_CONSTRAINTS = ["without using any library functions", "in O(n) time", "using recursion",
                    "with clear comments", "and explain its time complexity", "and handle empty input"]

CODE_TASKS = ["finds the second largest number in a list", "checks whether a year is a leap year",
              "counts how many times each character appears in a string", "merges overlapping intervals",
              "returns the k most common words in a text", "checks whether brackets in a string are balanced",
              "computes the median of a list", "converts a number to binary", "finds all pairs that sum to a "
              "target", "capitalizes the first letter of every word"]

WORD_PROBLEMS = [
    "A store sells notebooks at {b} dollars each and pens at {a2} dollars each. Maria buys {a} notebooks and "
    "twice as many pens. How much does she spend? Explain each step.",
    "A tank holds {c} litres. It is filled at {b} litres per minute and leaks {a2} litres per minute. How long "
    "does it take to fill? Show your reasoning.",
    "The sum of two numbers is {c} and their difference is {a}. What are the numbers?",
    "A class has {a} students. {p1} percent of them play football and {p2} percent of those also play "
    "chess. How many play both? Then explain how you would check the answer.",
    "A car travels {a} km at {b}0 km/h and then {c} km at {a2}0 km/h. What is its average speed for the "
    "whole trip?",
    "If the price of a jacket rises by {p1} percent and then falls by {p2} percent, is it cheaper or more "
    "expensive than at the start? By how much?",
    "Find the area of a triangle with vertices at (0, 0), ({b}, 0) and ({a2}, {a}). Then find its perimeter.",
    "I am thinking of a number. If I multiply it by {b} and add {a}, I get {c}. What is the number? Explain "
    "how you found it."]

PASSAGE_TASKS = [
    ("summarize", "Summarize the following text in {k} sentences.\n\n{text}"),
    ("summarize", "Summarize this for a busy reader:\n\n{text}"),
    ("summarize", "{text}\n\nSummarize the text above in one short paragraph."),
    ("translate", "Translate the following text into {lang}.\n\n{text}"),
    ("translate", "Translate into {lang}:\n\n{text}"),
    ("key-points", "Read the text below and list its main points as bullet points.\n\n{text}"),
    ("extract", "Extract every name, number and place mentioned in this text and return them as JSON.\n\n{text}"),
    ("rewrite", "Rewrite the following paragraph in a more {tone} tone.\n\n{text}"),
    ("title", "Give this text a title and a one-line summary.\n\n{text}"),
    ("main-idea", "What is the main idea of the passage below? Answer in two sentences.\n\n{text}"),
    ("proofread", "Proofread and improve the following text, then explain your changes briefly.\n\n{text}"),
    ("continue", "Continue this text with one more paragraph in the same style.\n\n{text}"),
    ("qa", "Document:\n{text}\n\nQuestion: According to the document, what is said about {word}?"),
    ("quiz", "Here is an article:\n\n{text}\n\nWrite three quiz questions about it, with answers."),
    ("qa", "{text}\n\nBased only on the text above, what are two things a reader should remember?")]

HUMAN_LANGUAGES = ["French", "German", "Spanish", "Italian", "Portuguese", "Dutch", "Chinese", "Japanese"]
TONES = ["formal", "casual", "enthusiastic", "neutral", "persuasive", "friendly"]


def chat_requests(n: int, seed: int = 0) -> list[dict]:
  """``n`` distinct chat-style requests: writing with constraints, personas, multi-part questions, code, word
  problems."""
  rng = random.Random(seed)
  topics = _all_topics()
  kinds = ["writing"] * 5 + ["persona"] * 2 + ["multipart"] * 4 + ["code"] * 2 + ["math"] * 2

  def draw():
    kind = rng.choice(kinds)
    t, u = rng.sample(topics, 2)
    if kind == "writing":
      opener = rng.choice(OPENERS).format(p=rng.choice(PEOPLE))
      verb = rng.choice(VERBS)
      if opener.endswith("and "):
        verb = verb.lower()
        opener += "I need you to "
      cons = " ".join(rng.sample(CONSTRAINTS, rng.randint(1, 3)))
      text = f"{opener}{verb} {rng.choice(FORMS)} about {t} {rng.choice(AUDIENCES)}. {cons}"
    elif kind == "persona":
      q = rng.choice(CHARACTER_QUESTIONS).format(t=t)
      who = rng.choice(CHARACTERS)
      text = rng.choice([f"Pretend to be {who} for the rest of this conversation. Stay in character. {q}",
                         f"You are {who}. Answer as that character would: {q}",
                         f"Role-play as {who} who has just arrived in {rng.choice(PLACES)}. {q}"])
    elif kind == "multipart":
      text = rng.choice(MULTI_PART).format(t=t, u=u, p=rng.choice(PEOPLE))
    elif kind == "code":
      if rng.random() < 0.5:
        lang, code = rng.choice(BUGGY_CODE)
        text = rng.choice(CODE_ASKS).format(lang=lang, code=code)
      else:
        text = (f"Write a {rng.choice(LANGUAGES)} function that {rng.choice(CODE_TASKS)}, "
                f"{rng.choice(CODE_CONSTRAINTS)}. Include an example of how to call it.")
    else:
      a, b = rng.randint(3, 40), rng.randint(2, 12)
      text = rng.choice(WORD_PROBLEMS).format(a=a, b=b, a2=rng.randint(2, 9), c=rng.randint(100, 900),
                                              p1=rng.choice([10, 20, 25, 40, 50]), p2=rng.choice([10, 20, 50]),
                                              p=rng.choice(PEOPLE))
    return f"chat-{kind}", text

  return distinct_records(n, draw, "chat", 200 * n, "chat requests")


def clip_passage(text: str, max_chars: int) -> str:
  """``text`` cut to at most ``max_chars`` at a sentence or paragraph end (whole text if it fits)."""
  text = text.strip()
  if len(text) <= max_chars:
    return text
  head = text[:max_chars]
  ends = [m.end() for m in re.finditer(r"[.!?](\s|$)|\n\n", head)]
  return head[:ends[-1]].strip() if ends and ends[-1] > max_chars // 3 else head.rsplit(" ", 1)[0].strip()


def _keyword(text: str, rng: random.Random) -> str:
  words = [w for w in re.findall(r"[A-Za-z][a-z]{5,}", text)]
  return rng.choice(words).lower() if words else "the main topic"


def passage_requests(passages: Sequence[str], n: int, seed: int = 0, max_chars: int = 900) -> list[dict]:
  """``n`` distinct tasks over ``passages`` (summarize, translate, extract, rewrite, answer from a document),
  each passage clipped to ``max_chars`` (translations to a third of that)."""
  usable = [p for p in passages if len(p.strip()) >= 200]
  if not usable:
    raise ValueError("passage_requests needs passages of at least 200 characters")
  rng = random.Random(seed)

  def draw():
    src = rng.choice(usable)
    tag, task = rng.choice(PASSAGE_TASKS)
    limit = max_chars // 3 if tag == "translate" else max_chars
    text = clip_passage(src, rng.randint(limit // 2, limit))
    prompt = task.format(text=text, k=rng.choice([1, 2, 3]), lang=rng.choice(HUMAN_LANGUAGES),
                         tone=rng.choice(TONES), word=_keyword(text, rng))
    return f"passage-{tag}", prompt

  return distinct_records(n, draw, "passage", 50 * n, f"passage tasks from {len(usable)} passages")
