/*
 * guard-hook AGENT: the hook an agent runs before and after each tool, in a few
 * milliseconds. It forwards the agent's hook JSON (stdin) to the guard's agent socket as
 * one `hook` message; the daemon decides with sandbox/agents/fasthook.py's own logic and
 * answers {"exit": N, "stderr": "..."}; this prints the text to stderr and exits with N (2
 * blocks the tool in the agents' convention).
 *
 * It settles only that common case. Whatever else happens — input it cannot forward as one
 * line (over 4 MiB, a raw newline inside a string, not an object), a guard that is not there,
 * rejects the message (nesting, UTF-8, types: it reads the event, this file does not) or
 * answers anything but that one reply — it hands the same stdin to the Python hook
 * (`python3 -S -E fasthook.py AGENT`, exec'd: same process, same exit status), so that the
 * two cannot answer differently (tests/test_hook_parity.py). When the message was sent and
 * may have been counted, the Python hook is told why the guard is unreachable instead of
 * asking it a second time. Only when that Python cannot be started does this file answer
 * alone: it refuses (fail closed).
 *
 * Built by guard run with the system's C compiler; where there is none, the agents get
 * the Python hook itself.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

/* As fasthook.MAX_HOOK_INPUT, _REPLY_MAX and _TIMEOUT_S. */
#define MAX_INPUT (4 << 20)
#define REPLY_MAX (1 << 20)
#define TIMEOUT_S 5

/* What differs between agents comes from the agents' table (sandbox/agents/registry.py), the
 * protocol version from sandbox/agents/fasthook.py and the Python hook's command line from
 * the interpreter that built this: sandbox/agents/hooks.py passes them with -D when it
 * compiles this file (see its helper_defines()). */
#if !defined(GUARD_PROTOCOL_VERSION) || !defined(GUARD_AGENT_BLOCK) || !defined(GUARD_PYTHON) || \
    !defined(GUARD_FASTHOOK)
#error "build guard_hook.c through sandbox/agents/hooks.py: it passes the agents' table with -D"
#endif

#define STR2(x) #x
#define STR(x) STR2(x)

struct agent_block { const char *name; int status; };
static const struct agent_block BLOCK[] = {GUARD_AGENT_BLOCK {NULL, 2}};

/* The exit status that blocks a tool in this agent's convention. */
static int block_status(const char *agent) {
    const struct agent_block *b = BLOCK;
    while (b->name && strcmp(b->name, agent)) b++;
    return b->status;
}

static const char *agent = "claude";
static char *input;   /* stdin as read: at most MAX_INPUT + 1 bytes */
static size_t input_len;

static int write_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Hand the call to the Python hook: stdin as read, and, when the guard got the message but gave
 * no usable answer, why (so that it is not asked twice). Returns only if Python cannot be run. */
static int python_hook(const char *unreachable) {
    int fd = memfd_create("guard-hook-stdin", MFD_CLOEXEC);
    if (fd >= 0 && write_all(fd, input, input_len) == 0 && lseek(fd, 0, SEEK_SET) == 0 && dup2(fd, 0) == 0) {
        char *argv[] = {GUARD_PYTHON, "-S", "-E", GUARD_FASTHOOK, (char *)agent,
                        unreachable ? "--guard-unreachable" : NULL, (char *)unreachable, NULL};
        execv(GUARD_PYTHON, argv);
    }
    fprintf(stderr, "guard: refusing the tool: the guard's Python hook (%s %s) cannot be started here (%s); "
            "the sandbox must show the interpreter guard runs with: install guardfs where the agent can read it\n",
            GUARD_PYTHON, GUARD_FASTHOOK, strerror(errno));
    return block_status(agent);
}

/* The hook event as the value of a one-line message: a raw newline between tokens is white
 * space (a space is the same to JSON); one inside a string is not JSON at all (0). */
static int one_line(char *text, size_t len) {
    int in_string = 0, escaped = 0;
    for (size_t i = 0; i < len; i++) {
        char c = text[i];
        if (in_string) {
            if (escaped) escaped = 0;
            else if (c == '\\') escaped = 1;
            else if (c == '"') in_string = 0;
            else if (c == '\n') return 0;
        } else if (c == '"') {
            in_string = 1;
        } else if (c == '\n') {
            text[i] = ' ';
        }
    }
    return 1;
}

/* Append the UTF-8 form of code point cp (a lone surrogate as Python's stderr writes it,
 * backslash-escaped) to out; returns the new length. */
static size_t put_code_point(char *out, size_t n, unsigned int cp) {
    if (cp < 0x80) {
        out[n++] = (char)cp;
    } else if (cp < 0x800) {
        out[n++] = (char)(0xC0 | (cp >> 6));
        out[n++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp >= 0xD800 && cp <= 0xDFFF) {
        n += (size_t)sprintf(out + n, "\\u%04x", cp);
    } else if (cp < 0x10000) {
        out[n++] = (char)(0xE0 | (cp >> 12));
        out[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[n++] = (char)(0x80 | (cp & 0x3F));
    } else {
        out[n++] = (char)(0xF0 | (cp >> 18));
        out[n++] = (char)(0x80 | ((cp >> 12) & 0x3F));
        out[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[n++] = (char)(0x80 | (cp & 0x3F));
    }
    return n;
}

static int hex4(const char *p, unsigned int *cp) {
    *cp = 0;
    for (int i = 0; i < 4; i++) {
        char h = p[i];
        unsigned int d = h >= '0' && h <= '9' ? (unsigned)(h - '0') : h >= 'a' && h <= 'f' ? (unsigned)(h - 'a' + 10)
                       : h >= 'A' && h <= 'F' ? (unsigned)(h - 'A' + 10) : 16;
        if (d == 16) return -1;
        *cp = *cp * 16 + d;
    }
    return 0;
}

/* Decode the JSON string body at p (after its opening quote) into out, which has room for it;
 * returns a pointer past its closing quote, or NULL when it is not a valid JSON string. */
static const char *json_string(const char *p, const char *end, char *out, size_t *len) {
    size_t n = 0;
    while (p < end && *p != '"') {
        unsigned char c = (unsigned char)*p++;
        if (c < 0x20) return NULL;
        if (c != '\\') {
            out[n++] = (char)c;
            continue;
        }
        if (p >= end) return NULL;
        char e = *p++;
        unsigned int cp;
        switch (e) {
        case '"': case '\\': case '/': out[n++] = e; break;
        case 'b': out[n++] = '\b'; break;
        case 'f': out[n++] = '\f'; break;
        case 'n': out[n++] = '\n'; break;
        case 'r': out[n++] = '\r'; break;
        case 't': out[n++] = '\t'; break;
        case 'u':
            if (end - p < 4 || hex4(p, &cp)) return NULL;
            p += 4;
            unsigned int low;
            if (cp >= 0xD800 && cp <= 0xDBFF && end - p >= 6 && p[0] == '\\' && p[1] == 'u' && !hex4(p + 2, &low) &&
                low >= 0xDC00 && low <= 0xDFFF) {
                cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
                p += 6;
            }
            n = put_code_point(out, n, cp);
            break;
        default: return NULL;
        }
    }
    if (p >= end) return NULL;
    *len = n;
    return p + 1;
}

/* Whether the reply line [p, end) is the daemon's answer to a hook message; if so, its exit
 * status and text. Anything else (another shape, another order) is for the Python hook. */
static int hook_answer(const char *p, const char *end, int *code, char *text, size_t *text_len) {
    static const char head[] = "{\"v\":" STR(GUARD_PROTOCOL_VERSION) ",\"ok\":true,\"exit\":";
    static const char mid[] = ",\"stderr\":\"";
    if ((size_t)(end - p) < sizeof head - 1 || memcmp(p, head, sizeof head - 1)) return 0;
    p += sizeof head - 1;
    int value = 0, digits = 0;
    while (p < end && *p >= '0' && *p <= '9' && digits < 3) value = value * 10 + (*p++ - '0'), digits++;
    if (!digits || value > 255 || (size_t)(end - p) < sizeof mid - 1 || memcmp(p, mid, sizeof mid - 1)) return 0;
    p += sizeof mid - 1;
    p = json_string(p, end, text, text_len);
    if (!p || end - p != 1 || *p != '}') return 0;
    *code = value;
    return 1;
}

int main(int argc, char **argv) {
    if (argc > 1) agent = argv[1];
    input = malloc(MAX_INPUT + 2);
    char *line = malloc(MAX_INPUT + 256);
    char *reply = malloc(REPLY_MAX + 1);
    char *text = malloc(REPLY_MAX + 1);
    if (!input || !line || !reply || !text) {
        fprintf(stderr, "guard: refusing the tool: the guard's hook has no memory\n");
        return block_status(agent);
    }
    for (;;) {
        ssize_t n = read(0, input + input_len, MAX_INPUT + 1 - input_len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        input_len += (size_t)n;
        if (input_len == MAX_INPUT + 1) break;
    }
    if (input_len > MAX_INPUT) return python_hook(NULL);  /* it words the refusal */

    int hl = snprintf(line, 256, "{\"v\":%d,\"type\":\"hook\",\"agent\":\"", GUARD_PROTOCOL_VERSION);
    for (const char *a = agent; *a && hl < 200; a++) {  /* an agent name is a word; anything else is refused */
        if (*a == '"' || *a == '\\' || (unsigned char)*a < 0x20) return python_hook(NULL);
        line[hl++] = *a;
    }
    hl += sprintf(line + hl, "\",\"event\":");
    size_t start = 0;
    while (start < input_len && strchr(" \t\r\n", input[start]) && input[start]) start++;
    if (start == input_len || input[start] != '{') return python_hook(NULL);  /* not an object */
    memcpy(line + hl, input, input_len);
    if (!one_line(line + hl, input_len)) return python_hook(NULL);
    size_t len = (size_t)hl + input_len;
    memcpy(line + len, "}\n", 2);
    len += 2;

    const char *path = getenv("GUARD_SOCKET");
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (!path || !*path || strlen(path) >= sizeof addr.sun_path) return python_hook(NULL);
    strcpy(addr.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct timeval timeout = {.tv_sec = TIMEOUT_S};
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout) ||
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout) ||
        connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0)
        return python_hook(NULL);  /* nothing was sent: it asks, and says why it cannot */

    char why[600];
    for (size_t sent = 0; sent < len;) {
        ssize_t n = send(fd, line + sent, len - sent, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {  /* a line cut off is never read as a message */
            snprintf(why, sizeof why, "cannot reach the guard at %s: %s", path,
                     errno == EAGAIN ? "timed out" : strerror(errno));
            return python_hook(why);
        }
        sent += (size_t)n;
    }
    size_t got = 0;
    char *nl = NULL;
    while (!nl && got < REPLY_MAX) {
        ssize_t n = read(fd, reply + got, REPLY_MAX - got);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            snprintf(why, sizeof why, "cannot reach the guard at %s: %s", path,
                     errno == EAGAIN ? "timed out" : strerror(errno));
            return python_hook(why);
        }
        if (n == 0) break;
        nl = memchr(reply + got, '\n', (size_t)n);
        got += (size_t)n;
    }
    close(fd);
    if (!nl) {
        snprintf(why, sizeof why, got == 0 ? "the guard at %s closed the connection without replying"
                 : got < REPLY_MAX ? "the guard at %s closed the connection mid-reply"
                 : "the guard at %s sent a reply this hook cannot read", path);
        return python_hook(why);
    }
    static const char refused[] = "{\"v\":" STR(GUARD_PROTOCOL_VERSION) ",\"ok\":false,";
    if ((size_t)(nl - reply) >= sizeof refused - 1 && !memcmp(reply, refused, sizeof refused - 1))
        return python_hook(NULL);  /* not read as a message: nothing was counted, it asks again */
    int code;
    size_t text_len;
    if (!hook_answer(reply, nl, &code, text, &text_len))
        return python_hook(NULL);  /* a whole line of another shape: never the guard's answer to a hook, so
                                    * nothing it counted; the Python hook asks and reads what it gets */
    if (text_len) {
        text[text_len++] = '\n';
        write_all(2, text, text_len);
    }
    return code;
}
