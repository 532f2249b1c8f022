"""Code-task prompts made offline, for drafters of a code model: function stubs to complete, functions to
write from a description, other languages, classes, tests, fixes and explanations — over the project's own
list of small tasks (none from a benchmark).  ``code_requests(n, seed)`` is deterministic and every prompt is
distinct.

A stub is a Python signature with a docstring, given to the model the way a HumanEval record is
(``prompts.wrap_code_stub``) or under other instructions, so that a drafter learns the replies a code model
writes to such requests: the restated function, its body, a short explanation.
"""
from __future__ import annotations

import random

from specjax.prompts import wrap_code_stub
from specjax.training.synth_prompts import distinct_records

# (name, parameters, return type, what it does).  Types are Python's; descriptions use the parameter names.
TASKS = [
    ("count_vowels", "text: str", "int", "Return how many vowels (a, e, i, o, u, either case) `text` contains."),
    ("is_anagram", "a: str, b: str", "bool", "Return True if `a` and `b` use the same letters the same number of "
     "times, ignoring case and spaces."),
    ("running_max", "values: list[int]", "list[int]", "Return a list whose i-th element is the largest of "
     "values[0..i]."),
    ("chunk", "items: list, size: int", "list[list]", "Split `items` into consecutive lists of `size` elements; "
     "the last one may be shorter."),
    ("flatten", "nested: list", "list", "Flatten arbitrarily nested lists into one flat list, keeping order."),
    ("word_frequencies", "text: str", "dict[str, int]", "Count how often each lower-cased word occurs in `text`, "
     "ignoring punctuation."),
    ("caesar_shift", "text: str, shift: int", "str", "Shift every letter of `text` by `shift` places in the "
     "alphabet, wrapping around and keeping case; other characters stay."),
    ("digit_sum", "n: int", "int", "Return the sum of the decimal digits of the absolute value of `n`."),
    ("is_prime", "n: int", "bool", "Return True if `n` is a prime number."),
    ("primes_below", "limit: int", "list[int]", "Return every prime smaller than `limit`, in increasing order."),
    ("gcd_of_list", "numbers: list[int]", "int", "Return the greatest common divisor of all the numbers."),
    ("roman_to_int", "numeral: str", "int", "Convert a Roman numeral such as 'XIV' to an integer."),
    ("int_to_roman", "n: int", "str", "Convert an integer between 1 and 3999 to a Roman numeral."),
    ("balanced_brackets", "s: str", "bool", "Return True if every bracket in `s` ((), [], {}) is closed in the "
     "right order."),
    ("longest_common_prefix", "words: list[str]", "str", "Return the longest prefix shared by every word."),
    ("rotate_list", "items: list, k: int", "list", "Rotate `items` to the right by `k` positions."),
    ("pairs_with_sum", "numbers: list[int], target: int", "list[tuple[int, int]]", "Return every pair of "
     "numbers (i < j by position) that adds up to `target`."),
    ("second_smallest", "numbers: list[int]", "int | None", "Return the second smallest distinct number, or None "
     "if there is none."),
    ("title_case", "sentence: str", "str", "Capitalise the first letter of every word and lower-case the rest."),
    ("compress_runs", "s: str", "str", "Run-length encode `s`: 'aaabcc' becomes 'a3b1c2'."),
    ("expand_runs", "s: str", "str", "Undo run-length encoding: 'a3b1c2' becomes 'aaabcc'."),
    ("matrix_transpose", "matrix: list[list[int]]", "list[list[int]]", "Return the transpose of a rectangular "
     "matrix."),
    ("matrix_multiply", "a: list[list[float]], b: list[list[float]]", "list[list[float]]", "Multiply two "
     "matrices given as lists of rows."),
    ("spiral_order", "matrix: list[list[int]]", "list[int]", "Return the elements of the matrix in clockwise "
     "spiral order, starting at the top left."),
    ("binary_search", "sorted_items: list[int], target: int", "int", "Return the index of `target` in the "
     "sorted list, or -1 if it is absent."),
    ("merge_intervals", "intervals: list[tuple[int, int]]", "list[tuple[int, int]]", "Merge overlapping "
     "closed intervals and return them sorted by start."),
    ("moving_average", "values: list[float], window: int", "list[float]", "Return the averages of every "
     "`window` consecutive values."),
    ("median", "values: list[float]", "float", "Return the median of a non-empty list."),
    ("mode", "values: list[int]", "int", "Return the most common value; on a tie, the smallest of them."),
    ("normalize_scores", "scores: list[float]", "list[float]", "Rescale the scores linearly so the smallest "
     "becomes 0.0 and the largest 1.0 (all 0.0 if they are equal)."),
    ("fizzbuzz_line", "n: int", "str", "Return 'Fizz' for multiples of 3, 'Buzz' for multiples of 5, "
     "'FizzBuzz' for both, else the number as a string."),
    ("collatz_steps", "n: int", "int", "Return how many Collatz steps it takes `n` to reach 1."),
    ("fibonacci_upto", "limit: int", "list[int]", "Return the Fibonacci numbers not larger than `limit`."),
    ("factorial_digits", "n: int", "int", "Return the number of digits of n!."),
    ("is_palindrome_number", "n: int", "bool", "Return True if the decimal digits of `n` read the same "
     "backwards."),
    ("remove_duplicates", "items: list", "list", "Remove repeated elements, keeping the first occurrence of "
     "each and the original order."),
    ("group_by_length", "words: list[str]", "dict[int, list[str]]", "Group the words by their length."),
    ("invert_dict", "mapping: dict", "dict", "Swap keys and values; when values repeat, keep a list of the keys."),
    ("deep_merge", "a: dict, b: dict", "dict", "Merge `b` into a copy of `a`, merging nested dictionaries "
     "instead of replacing them."),
    ("parse_key_values", "line: str", "dict[str, str]", "Parse 'key1=value1; key2=value2' into a dictionary, "
     "stripping spaces."),
    ("format_duration", "seconds: int", "str", "Format a number of seconds as 'Hh Mm Ss', leaving out zero "
     "parts."),
    ("parse_time", "text: str", "int", "Convert a 'HH:MM' clock time to minutes after midnight."),
    ("days_between", "start: str, end: str", "int", "Return the number of days between two 'YYYY-MM-DD' dates."),
    ("is_leap_year", "year: int", "bool", "Return True if `year` is a leap year in the Gregorian calendar."),
    ("valid_email", "address: str", "bool", "Return True if `address` looks like a valid e-mail address: one "
     "'@', a non-empty name and a domain with a dot."),
    ("camel_to_snake", "name: str", "str", "Convert a camelCase identifier to snake_case."),
    ("snake_to_camel", "name: str", "str", "Convert a snake_case identifier to camelCase."),
    ("count_islands", "grid: list[list[int]]", "int", "Count groups of 1s connected horizontally or vertically "
     "in a grid of 0s and 1s."),
    ("shortest_path_length", "graph: dict[str, list[str]], start: str, goal: str", "int", "Return the number "
     "of edges on a shortest path from `start` to `goal`, or -1 if there is none."),
    ("topological_order", "deps: dict[str, list[str]]", "list[str]", "Return an order of the tasks in which "
     "every task comes after the tasks it depends on."),
    ("has_cycle", "graph: dict[int, list[int]]", "bool", "Return True if the directed graph has a cycle."),
    ("knapsack", "weights: list[int], values: list[int], capacity: int", "int", "Return the largest total value "
     "of items whose weights fit in `capacity` (each item at most once)."),
    ("coin_change", "coins: list[int], amount: int", "int", "Return the fewest coins that make up `amount`, or "
     "-1 if it cannot be made."),
    ("edit_distance", "a: str, b: str", "int", "Return the Levenshtein distance between two strings."),
    ("longest_increasing_run", "values: list[int]", "int", "Return the length of the longest strictly "
     "increasing run of consecutive elements."),
    ("max_subarray_sum", "values: list[int]", "int", "Return the largest sum of a non-empty contiguous "
     "sub-list."),
    ("product_except_self", "values: list[int]", "list[int]", "Return a list whose i-th element is the product "
     "of all values except values[i], without using division."),
    ("sort_by_frequency", "values: list[int]", "list[int]", "Sort the values by how often they occur, most "
     "frequent first, ties by value."),
    ("kth_largest", "values: list[int], k: int", "int", "Return the k-th largest value (k = 1 is the largest)."),
    ("to_binary", "n: int", "str", "Return the binary representation of a non-negative integer without the "
     "'0b' prefix."),
    ("from_base", "digits: str, base: int", "int", "Convert a string of digits in `base` (2 to 16) to an "
     "integer."),
    ("count_bits", "n: int", "int", "Return how many 1 bits the binary form of a non-negative `n` has."),
    ("triangle_type", "a: float, b: float, c: float", "str", "Return 'equilateral', 'isosceles', 'scalene', or "
     "'invalid' if the sides cannot form a triangle."),
    ("polygon_area", "points: list[tuple[float, float]]", "float", "Return the area of a simple polygon given "
     "its vertices in order."),
    ("closest_pair", "points: list[tuple[float, float]]", "float", "Return the smallest distance between two "
     "of the points."),
    ("mask_card_number", "number: str", "str", "Replace every digit except the last four with '*'."),
    ("luhn_valid", "number: str", "bool", "Return True if a string of digits passes the Luhn checksum."),
    ("wrap_text", "text: str, width: int", "list[str]", "Break `text` into lines of at most `width` characters "
     "without splitting words."),
    ("justify_line", "words: list[str], width: int", "str", "Spread the words over exactly `width` characters, "
     "putting extra spaces in the leftmost gaps."),
    ("parse_csv_line", "line: str", "list[str]", "Split one CSV line into fields, honouring double-quoted "
     "fields that contain commas."),
    ("most_common_char", "text: str", "str", "Return the most frequent non-space character; on a tie, the one "
     "that appears first."),
    ("unique_paths", "rows: int, cols: int", "int", "Count the paths from the top-left to the bottom-right "
     "cell of a grid moving only right or down."),
    ("stock_profit", "prices: list[int]", "int", "Return the best profit from buying once and selling later, "
     "or 0."),
    ("evaluate_rpn", "tokens: list[str]", "float", "Evaluate an expression in reverse Polish notation with "
     "+, -, * and /."),
    ("next_permutation", "values: list[int]", "list[int]", "Return the next lexicographic permutation of the "
     "values, or the smallest one after the largest."),
    ("power_set", "items: list", "list[list]", "Return every subset of `items`."),
    ("histogram", "values: list[int]", "str", "Return a text histogram with one line per distinct value, "
     "'value: ' followed by that many '#'."),
    ("celsius_table", "start: int, stop: int, step: int", "list[tuple[int, float]]", "Return (celsius, "
     "fahrenheit) pairs from `start` to `stop` inclusive."),
    ("safe_divide", "a: float, b: float", "float | None", "Return a / b, or None when `b` is zero."),
    ("clamp", "value: float, low: float, high: float", "float", "Limit `value` to the range [low, high]."),
    ("interleave", "a: list, b: list", "list", "Alternate the elements of the two lists; the rest of the "
     "longer one goes at the end."),
    ("zigzag", "text: str, rows: int", "str", "Write `text` in a zigzag over `rows` rows and read it row by "
     "row."),
    ("longest_palindrome", "s: str", "str", "Return the longest palindromic substring (the first one on a tie)."),
    ("anagram_groups", "words: list[str]", "list[list[str]]", "Group words that are anagrams of each other."),
    ("validate_sudoku_row", "row: list[int]", "bool", "Return True if the row holds the digits 1 to 9 once each."),
    ("bank_balance", "transactions: list[tuple[str, float]]", "float", "Apply ('deposit' or 'withdraw', "
     "amount) transactions to a zero balance, ignoring withdrawals that would make it negative."),
]

LANGUAGES = ["JavaScript", "TypeScript", "Go", "Rust", "Java", "C++", "C#", "Ruby", "Kotlin", "Swift"]

CLASSES = [
    ("Stack", "push, pop, peek and is_empty"), ("Queue", "enqueue, dequeue and size, backed by two stacks"),
    ("LRUCache", "get and put with a fixed capacity, evicting the least recently used key"),
    ("BankAccount", "deposit, withdraw (refusing overdrafts) and a transaction history"),
    ("Matrix", "addition, multiplication and transpose, with a readable __repr__"),
    ("Inventory", "add_item, remove_item and total_value over items with a price and a quantity"),
    ("Vector2D", "addition, scaling, dot product and length"), ("TodoList", "add, complete, and list open tasks"),
    ("RateLimiter", "allow(), which permits at most n calls per rolling window of t seconds"),
    ("Trie", "insert, search and starts_with"), ("MinHeap", "push, pop and peek, written without heapq"),
    ("Graph", "add_edge, neighbours and a breadth-first search"),
]

STUB_INSTRUCTIONS = [
    None,   # the project's HumanEval wrapping (prompts.wrap_code_stub)
    "Implement this function:\n\n```python\n{stub}```",
    "Fill in the body of the following Python function.\n\n{stub}",
    "Here is a function signature with its docstring. Write the implementation and explain it briefly.\n\n"
    "```python\n{stub}```",
    "Complete the code below so that it does what the docstring says.\n\n```python\n{stub}```",
]

ASKS = [
    "Write a Python function `{name}({params})` that does the following: {desc}",
    "Write a Python function {name} that takes {params_text} and returns {ret_text}. {desc} Include a docstring "
    "and a few example calls.",
    "I need a Python helper called {name}. {desc} Please add type hints.",
    "Implement {name} in {lang}. {desc}",
    "Write {name} in Python {constraint}. {desc}",
    "Write unit tests with pytest for a function {name}({params}) whose job is: {desc}",
    "Write a Python function {name}({params}). {desc} Then explain its time complexity.",
]

CONSTRAINTS = ["without using any imports", "using a single loop", "in an idiomatic, readable way",
               "using recursion", "with clear error handling for bad input", "using only built-in functions",
               "in as few lines as is still readable"]

CLASS_ASKS = ["Write a Python class {name} with {methods}.", "Implement a {name} class in {lang} that supports "
              "{methods}.", "Design a small {name} class in Python ({methods}) and show how to use it."]


def stub(name: str, params: str, ret: str, desc: str) -> str:
  """A Python function stub: signature and docstring, indented like hand-written code."""
  return f'def {name}({params}) -> {ret}:\n    """{desc}\n    """\n'


def _describe_params(params: str) -> str:
  names = [p.split(":")[0].strip() for p in params.split(",")]
  return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def code_requests(n: int, seed: int = 0) -> list[dict]:
  """``n`` distinct code-task prompts ``{"id", "category", "prompt"}``, deterministic for a seed."""
  if n <= 0:
    return []
  rng = random.Random(seed)

  def draw():
    kind = rng.random()
    if kind < 0.45:                       # a stub to complete
      name, params, ret, desc = rng.choice(TASKS)
      text = stub(name, params, ret, desc)
      form = rng.choice(STUB_INSTRUCTIONS)
      return "code-stub", wrap_code_stub(text) if form is None else form.format(stub=text)
    if kind < 0.9:                        # a function from a description
      name, params, ret, desc = rng.choice(TASKS)
      ask = rng.choice(ASKS)
      return "code-write", ask.format(name=name, params=params, desc=desc, lang=rng.choice(LANGUAGES),
                                      params_text=_describe_params(params), ret_text=f"a {ret}",
                                      constraint=rng.choice(CONSTRAINTS))
    name, methods = rng.choice(CLASSES)
    return "code-class", rng.choice(CLASS_ASKS).format(name=name, methods=methods, lang=rng.choice(LANGUAGES))

  return distinct_records(n, draw, "code", max_draws=50 * n, what="code requests")
