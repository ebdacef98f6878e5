"""Types of guardfs._fusereply, the C module (guardfs/_fusereply.c)."""

FLAG_SHIFT: int
CACHE_DIR: int
NOFLUSH: int

def seen() -> int: ...
def applied() -> int: ...
