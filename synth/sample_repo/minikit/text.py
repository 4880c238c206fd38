"""Text helpers: slugs, word wrapping, counting and truncation."""


def slugify(text, sep="-"):
    words = []
    current = []
    for ch in text.lower():
        if ch.isalnum():
            current.append(ch)
        elif current:
            words.append("".join(current))
            current = []
    if current:
        words.append("".join(current))
    return sep.join(words)


def wrap(text, width):
    if width < 1:
        raise ValueError("width must be positive")
    lines = []
    line = ""
    for word in text.split():
        if not line:
            line = word
        elif len(line) + 1 + len(word) <= width:
            line = line + " " + word
        else:
            lines.append(line)
            line = word
    if line:
        lines.append(line)
    return lines


def count_words(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts


def truncate(text, limit, suffix="..."):
    if len(text) <= limit:
        return text
    keep = limit - len(suffix)
    if keep <= 0:
        return suffix[:limit]
    return text[:keep] + suffix


def is_palindrome(text):
    letters = [c.lower() for c in text if c.isalnum()]
    return letters == letters[::-1]


def initials(name):
    parts = [p for p in name.split() if p]
    return "".join(p[0].upper() for p in parts)
