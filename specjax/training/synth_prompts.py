"""Training prompts made offline: templated instructions over topic lists.

A drafter is trained on what the target says, so the prompts only have to be varied: many kinds of request
(explain, write, reason, compute, code, extract, advise, role-play) over many subjects.  Nothing here comes
from a benchmark; ``synthesize(n, seed)`` is deterministic, and every prompt is distinct.

The target can also write prompts itself: ``self_written_seed_prompts`` gives the requests that ask it to,
``questions_from_replies`` turns its answers into prompts (``prepare.prepare_data`` runs both rounds).
"""
from __future__ import annotations

import random
import re
from typing import Sequence

TOPICS = {
    "science": ["photosynthesis", "black holes", "plate tectonics", "the immune system", "DNA replication",
                "climate change", "the water cycle", "electric circuits", "volcanoes", "antibiotics",
                "the speed of light", "magnetism", "ocean tides", "vaccines", "the periodic table",
                "evolution by natural selection", "the human heart", "earthquakes", "nuclear fusion",
                "bacteria and viruses", "rainbows", "gravity", "the moon's phases", "coral reefs",
                "sound waves", "batteries", "the greenhouse effect", "stem cells", "sleep", "bees"],
    "technology": ["the internet", "smartphones", "machine learning", "solar panels", "electric cars",
                   "password security", "cloud computing", "3D printing", "GPS", "databases",
                   "video compression", "open-source software", "robots in factories", "wind turbines",
                   "search engines", "email spam filters", "blockchains", "computer memory", "Wi-Fi",
                   "self-driving cars", "spreadsheets", "compilers", "digital cameras", "satellites"],
    "history": ["the Roman Empire", "the printing press", "the Industrial Revolution", "ancient Egypt",
                "the Silk Road", "the French Revolution", "the first moon landing", "the Renaissance",
                "the invention of writing", "the Cold War", "the Vikings", "the Ming dynasty",
                "the abolition of slavery", "the Great Depression", "the Olympic Games' origins",
                "the Inca Empire", "medieval castles", "the history of medicine", "the telegraph",
                "women's suffrage", "the Ottoman Empire", "the steam engine"],
    "society": ["remote work", "public libraries", "city parks", "recycling", "social media",
                "volunteering", "voting", "minimum wage", "public transport", "homeschooling",
                "four-day work weeks", "tourism", "urban gardening", "online privacy", "fast fashion",
                "museums", "community sports", "aging populations", "small businesses", "immigration"],
    "daily life": ["cooking on a budget", "learning a new language", "saving money", "morning routines",
                   "keeping houseplants alive", "moving to a new city", "planning a wedding",
                   "training a puppy", "starting to run", "organizing a closet", "making friends as an adult",
                   "job interviews", "studying for exams", "time management", "a first camping trip",
                   "baking bread", "hosting a dinner party", "reducing screen time", "buying a used car",
                   "writing a resume", "meditation", "learning to swim", "a family road trip"],
    "arts": ["jazz", "impressionist painting", "poetry", "photography", "film editing", "origami",
             "classical music", "street art", "theatre", "pottery", "architecture", "dance", "comics",
             "opera", "sculpture", "graphic design", "folk tales", "video games as art", "calligraphy"],
    "economics": ["inflation", "supply and demand", "interest rates", "taxes", "international trade",
                  "startups", "stock markets", "unemployment", "budgets", "insurance", "credit scores",
                  "the gig economy", "monopolies", "renewable energy markets", "housing prices"],
    "nature": ["wolves", "rainforests", "migratory birds", "deserts", "octopuses", "mushrooms", "whales",
               "glaciers", "honeybees", "tigers", "wetlands", "ants", "penguins", "oak trees", "rivers",
               "mountains", "butterflies", "sharks", "bamboo", "elephants"],
}

PEOPLE = ["a nervous first-year student", "a retired sailor", "a busy nurse", "a curious ten-year-old",
          "a small-town baker", "a software engineer", "a museum guide", "a startup founder", "a farmer",
          "a travelling musician", "a detective", "a librarian", "an astronaut", "a chef", "a park ranger",
          "a high-school teacher", "a journalist", "a grandmother", "a bicycle mechanic", "a marathon runner"]

PLACES = ["a rainy harbour town", "a space station", "a mountain village", "a crowded night market",
          "an old library", "a desert outpost", "a floating city", "a quiet suburb", "a research ship",
          "a medieval fair", "an abandoned factory", "a tropical island", "a train crossing Siberia"]

LANGUAGES = ["Python", "JavaScript", "C", "Rust", "Java", "Go", "SQL", "Bash"]

CODE_TASKS = ["reverses a linked list", "checks whether a string is a palindrome", "merges two sorted lists",
              "counts word frequencies in a text", "finds the n-th Fibonacci number",
              "removes duplicates from a list while keeping order", "parses a CSV line into fields",
              "computes the greatest common divisor of two numbers", "validates an email address",
              "finds the longest common prefix of a list of strings", "implements binary search",
              "converts Roman numerals to integers", "flattens a nested list", "rotates a matrix by 90 degrees",
              "checks if two words are anagrams", "returns the prime numbers below n",
              "computes a moving average", "implements a stack with push and pop",
              "groups records by a key", "finds the maximum subarray sum", "converts Celsius to Fahrenheit",
              "counts the vowels in a string", "implements a simple LRU cache", "sorts a list of tuples"]

TEMPLATES = {
    "explain": ["Explain {t} in simple terms.", "How does {t} work?", "What is {t}, and why does it matter?",
                "Give me a short overview of {t}.", "Explain {t} to a twelve-year-old.",
                "What are the most common misconceptions about {t}?",
                "Describe {t} in three paragraphs.", "What should a beginner know about {t}?",
                "Why do people find {t} interesting?", "Summarize the key ideas behind {t}."],
    "writing": ["Write a short poem about {t}.", "Write a blog post introduction about {t}.",
                "Write a persuasive paragraph arguing that everyone should learn about {t}.",
                "Write a short story that involves {t}.", "Write a product description for a book about {t}.",
                "Compose a haiku sequence about {t}.", "Write a friendly email inviting a colleague to a talk "
                "on {t}.", "Draft a speech opening for a conference on {t}.",
                "Write a limerick about {t}.", "Write a diary entry from someone discovering {t}."],
    "compare": ["Compare {t} and {u}.", "What do {t} and {u} have in common?",
                "Which is more important for the future, {t} or {u}? Argue both sides.",
                "Write a dialogue between two friends debating {t} versus {u}."],
    "lists": ["List five surprising facts about {t}.", "Give me ten tips about {t}.",
              "What are the pros and cons of {t}?", "List the main steps involved in {t}.",
              "Suggest five questions a student could ask about {t}.",
              "Name three books or resources to learn about {t} and say why."],
    "roleplay": ["Pretend you are {p} in {l}. Describe your day.",
                 "You are {p}. Explain {t} to a customer.", "Act as {p} and give advice about {t}.",
                 "Imagine you are {p} who just arrived in {l}. Write your first letter home.",
                 "Role-play a conversation between {p} and {q} about {t}.",
                 "You are a tour guide in {l}. Welcome a group of visitors."],
    "advice": ["I want to get better at {t}. Where should I start?",
               "My friend is worried about {t}. What should I tell them?",
               "Make a one-week plan for someone interested in {t}.",
               "What mistakes do people often make with {t}, and how can they avoid them?"],
}

MATH = ["What is {a} multiplied by {b}? Show your steps.", "If a train travels {a} km in {b} hours, what is its "
        "average speed?", "A shop sells pens at {b} dollars each. How much do {a} pens cost?",
        "Solve for x: {b}x + {a} = {c}.", "What is {a} percent of {c}?",
        "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        "If I save {b} dollars a week, how many weeks until I have {c} dollars?",
        "Is {c} a prime number? Explain how you check.", "What is the sum of the integers from 1 to {a}?",
        "A recipe for {b} people needs {a} grams of flour. How much for {c} people?",
        "Convert {c} minutes into hours and minutes.", "What is the average of {a}, {b} and {c}?"]

REASONING = ["If all {x} are {y} and some {y} are {z}, can we conclude that some {x} are {z}? Explain.",
             "Tom is taller than Ana, and Ana is taller than {n}. Who is the shortest? Explain your reasoning.",
             "A farmer has {a} sheep and all but {b} run away. How many are left?",
             "There are {a} people in a room and each shakes hands with everyone else once. How many handshakes?",
             "If today is {day}, what day of the week will it be in {a} days?",
             "I have {a} apples, give away {b}, then buy twice as many as I have left. How many do I have?"]

EXTRACTION = ["Extract the names of all people and places from this text: \"{p} met {q} in {l} to talk "
              "about {t}.\"", "Turn this sentence into a JSON object with fields who, where and topic: "
              "\"{p} gave a talk on {t} in {l}.\"", "Summarize in one sentence: \"{t} has changed a lot over "
              "the years. Many people now study it, and {p} says it will matter even more in the future.\"",
              "Classify the sentiment of this review as positive, negative or neutral: \"The workshop on {t} "
              "was {adj}.\""]

ADJ = ["wonderful and well organized", "boring and far too long", "fine, nothing special", "confusing at first "
       "but useful", "a complete waste of time", "inspiring", "too expensive for what it offered"]

WORDS = ["cats", "animals", "birds", "pets", "mammals", "poets", "artists", "musicians", "dreamers", "plants"]
NAMES = ["Sam", "Priya", "Lena", "Omar", "Kenji", "Maria", "Felix", "Zoe"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _all_topics() -> list[str]:
  return [t for ts in TOPICS.values() for t in ts]


def distinct_records(n: int, draw, prefix: str, max_draws: int, what: str) -> list[dict]:
  """``n`` records ``{"id": "<prefix>-<i>", "category", "prompt"}`` from ``draw() -> (category, text)``,
  repeated texts skipped; a ValueError naming ``what`` after ``max_draws`` draws that did not make ``n``."""
  seen: set[str] = set()
  out: list[dict] = []
  for _ in range(max_draws):
    if len(out) == n:
      break
    category, text = draw()
    if text not in seen:
      seen.add(text)
      out.append({"id": f"{prefix}-{len(out)}", "category": category, "prompt": text})
  if len(out) < n:
    raise ValueError(f"could not make {n} distinct {what} (got {len(out)})")
  return out


def synthesize(n: int, seed: int = 0) -> list[dict]:
  """``n`` distinct prompts as ``{"id", "category", "prompt"}`` records (the project's prompt format)."""
  rng = random.Random(seed)
  topics = _all_topics()
  kinds = (["explain"] * 4 + ["writing"] * 3 + ["lists"] * 2 + ["compare", "roleplay", "roleplay", "advice",
           "math", "math", "reasoning", "coding", "coding", "extraction"])

  def draw():
    kind = rng.choice(kinds)
    t, u = rng.sample(topics, 2)
    p, q = rng.sample(PEOPLE, 2)
    fill = dict(t=t, u=u, p=p, q=q, l=rng.choice(PLACES), a=rng.randint(3, 99), b=rng.randint(2, 12),
                c=rng.randint(100, 999), x=rng.choice(WORDS), y=rng.choice(WORDS), z=rng.choice(WORDS),
                n=rng.choice(NAMES), day=rng.choice(DAYS), adj=rng.choice(ADJ))
    if kind == "math":
      text = rng.choice(MATH).format(**fill)
    elif kind == "reasoning":
      text = rng.choice(REASONING).format(**fill)
    elif kind == "coding":
      lang, task = rng.choice(LANGUAGES), rng.choice(CODE_TASKS)
      text = rng.choice([f"Write a {lang} function that {task}.",
                         f"In {lang}, how would I write code that {task}? Explain it briefly.",
                         f"Write a {lang} function that {task}, and add a short test."])
    elif kind == "extraction":
      text = rng.choice(EXTRACTION).format(**fill)
    else:
      text = rng.choice(TEMPLATES[kind]).format(**fill)
    return kind, text

  return distinct_records(n, draw, "synth", 200 * n, "prompts: the templates are exhausted")


SELF_WRITTEN_ASKS = [
    "Write one question that {p} might ask an assistant about {t}. Reply with the question only.",
    "Write a request {p} might send to a helpful assistant about {t}. Reply with the request only.",
    "Think of a practical problem {p} could have that involves {t}, and state it as a question. Reply with "
    "the question only.",
    "Write a message in which {p} asks an assistant to write something about {t}. Reply with the message only.",
    "Write a question about {t} that needs careful step-by-step reasoning to answer. Reply with the question "
    "only.",
    "Write a request for advice that {p} might send about {t}. Reply with the request only.",
]


def self_written_seed_prompts(n: int, seed: int = 1) -> list[dict]:
  """Requests that ask the target to write a user's message itself (its reply becomes a training prompt):
  a kind of message, who sends it and a topic."""
  rng = random.Random(seed)
  topics = _all_topics()

  def draw():
    return "self", rng.choice(SELF_WRITTEN_ASKS).format(p=rng.choice(PEOPLE), t=rng.choice(topics))

  return distinct_records(n, draw, "self", 200 * n, "self-written prompt requests")


_LABEL = re.compile(r"^(?:\*\*)?(?:question|request|problem|message|a|q)\s*:\s*(?:\*\*)?\s*", re.I)
_QUOTED = re.compile(r"[:,]\s*[\"\u201c](.+?)(?:[\"\u201d]|$)")
# The target answering as the assistant instead of writing the user's message ("I'm here to help...").
_ASSISTANT_VOICE = re.compile(r"\b(?:assist\w*|AI|here to help|happy to help|your request)\b", re.I)


def _written_request(text: str) -> str:
  """The user's message in one answer to a ``self_written_seed_prompts`` request: a labelled line near the top
  ("Question: ..."), else a quotation after a colon or comma (``A journalist might ask: "..."``), else the
  line after one that ends in a colon, else a question after a colon, else the first line."""
  lines = [ln.strip() for ln in text.splitlines() if ln.strip()][:4]
  if not lines:
    return ""
  for ln in lines:
    label = _LABEL.match(ln)
    if label:
      return ln[label.end():]
  first = lines[0]
  quoted = _QUOTED.search(first)
  if quoted:
    return quoted.group(1)
  if first.endswith(":") and len(lines) > 1:
    return lines[1]
  after = first.rsplit(": ", 1)[-1]
  return after if after.endswith("?") else first


def questions_from_replies(replies: Sequence[str], min_chars: int = 15, max_chars: int = 400) -> list[str]:
  """The prompts in the target's answers to ``self_written_seed_prompts`` (``_written_request``), without
  quotes; answers too short or too long to be a request, answers in the assistant's voice, and repeats are
  dropped."""
  out, seen = [], set()
  for text in replies:
    line = _written_request(text).strip().strip('"\u201c\u201d\'*').strip()
    if min_chars <= len(line) <= max_chars and not _ASSISTANT_VOICE.search(line) and line not in seen:
      seen.add(line)
      out.append(line)
  return out
