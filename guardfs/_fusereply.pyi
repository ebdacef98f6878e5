"""Types of guardfs._fusereply, the C module (guardfs/_fusereply.c)."""

FLAG_SHIFT: int
CACHE_DIR: int
NOFLUSH: int
BY_INODE: int

def seen() -> int: ...
def applied() -> int: ...
def dirs_by_inode() -> bool: ...
