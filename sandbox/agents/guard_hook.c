/*
 * guard-hook AGENT: the hook an agent runs before and after each tool, in a few
 * milliseconds. It forwards the agent's hook JSON (stdin) to the guard's agent socket as
 * one `hook` message; the daemon decides (sandbox/agents/fasthook.py's logic) and answers
 * {"exit": N, "stderr": "..."}; this prints the text to stderr and exits with N (2 blocks
 * the tool in the agents' convention). If the guard cannot be reached, a mutating tool is
 * refused (fail closed) and anything else goes ahead with a warning.
 *
 * Built by guard run with the system's C compiler; where there is none, the agents get
 * `python3 -S -E fasthook.py`, which does the same more slowly.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX_INPUT (4 << 20)

/* What differs between agents comes from the agents' table (sandbox/agents/registry.py) and
 * the protocol version from sandbox/agents/fasthook.py: sandbox/agents/hooks.py passes them
 * with -D when it compiles this file (see its helper_defines()). */
#if !defined(GUARD_PROTOCOL_VERSION) || !defined(GUARD_MUTATING_TOOLS) || !defined(GUARD_BEFORE_EVENTS) || \
    !defined(GUARD_AGENT_BLOCK)
#error "build guard_hook.c through sandbox/agents/hooks.py: it passes the agents' table with -D"
#endif

/* Each list ends with a comma; NULL closes it. */
static const char *MUTATING[] = {GUARD_MUTATING_TOOLS NULL};
static const char *BEFORE[] = {GUARD_BEFORE_EVENTS NULL};
struct agent_block { const char *name; int status; };
static const struct agent_block BLOCK[] = {GUARD_AGENT_BLOCK {NULL, 2}};

/* The exit status that blocks a tool in this agent's convention. */
static int block_status(const char *agent) {
    const struct agent_block *b = BLOCK;
    while (b->name && strcmp(b->name, agent)) b++;
    return b->status;
}

static const char *agent = "claude";

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

/* The string value of "key" in a flat JSON text, copied into out (no unescaping needed for
 * the names compared here). Returns 0 when found. */
static int string_field(const char *json, const char *key, char *out, size_t size) {
    char pattern[64];
    snprintf(pattern, sizeof pattern, "\"%s\"", key);
    const char *p = strstr(json, pattern);
    if (!p) return -1;
    p += strlen(pattern);
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r' || *p == ':') p++;
    if (*p != '"') return -1;
    p++;
    size_t i = 0;
    while (*p && *p != '"' && i + 1 < size) {
        if (*p == '\\' && p[1]) p++;
        out[i++] = *p++;
    }
    out[i] = '\0';
    return 0;
}

static int fail(const char *input, const char *why) {
    char event[64] = "", tool[128] = "";
    string_field(input, "hook_event_name", event, sizeof event);
    string_field(input, "tool_name", tool, sizeof tool);
    int before = 0, mutating = 0;
    for (const char **b = BEFORE; *b; b++)
        if (!strcmp(event, *b)) before = 1;
    for (const char **m = MUTATING; *m; m++)
        if (!strcmp(tool, *m)) mutating = 1;
    if (before && mutating) {
        fprintf(stderr, "guard: refusing %s: the guard cannot be reached (%s); writes stay blocked until it is back\n",
                tool, why);
        return block_status(agent);
    }
    fprintf(stderr, "guard hook: %s\n", why);
    return 0;
}

/* Decode the JSON string starting after its opening quote at *p into stderr. */
static void print_json_string(const char *p) {
    char out[4096];
    size_t n = 0;
    while (*p && *p != '"') {
        unsigned int c = (unsigned char)*p++;
        if (c == '\\' && *p) {
            char e = *p++;
            switch (e) {
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': {
                unsigned int cp = 0;
                for (int i = 0; i < 4 && *p; i++, p++) {
                    char h = *p;
                    cp = cp * 16 + (unsigned int)(h >= 'a' ? h - 'a' + 10 : h >= 'A' ? h - 'A' + 10 : h - '0');
                }
                if (n + 4 >= sizeof out) { write_all(2, out, n); n = 0; }
                if (cp < 0x80) out[n++] = (char)cp;
                else if (cp < 0x800) { out[n++] = (char)(0xC0 | (cp >> 6)); out[n++] = (char)(0x80 | (cp & 0x3F)); }
                else { out[n++] = (char)(0xE0 | (cp >> 12)); out[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                       out[n++] = (char)(0x80 | (cp & 0x3F)); }
                continue;
            }
            default: c = (unsigned char)e;
            }
        }
        out[n++] = (char)c;
        if (n == sizeof out) { write_all(2, out, n); n = 0; }
    }
    write_all(2, out, n);
    write_all(2, "\n", 1);
}

int main(int argc, char **argv) {
    if (argc > 1) agent = argv[1];
    char *input = malloc(MAX_INPUT + 1);
    if (!input) return block_status(agent);
    size_t len = 0;
    for (;;) {
        ssize_t n = read(0, input + len, MAX_INPUT - len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        len += (size_t)n;
        if (len == MAX_INPUT) break;
    }
    input[len] = '\0';
    while (len > 0 && (input[len - 1] == '\n' || input[len - 1] == '\r' || input[len - 1] == ' ')) input[--len] = '\0';
    if (len == 0 || input[0] != '{') {
        fprintf(stderr, "guard hook %s: no JSON object on stdin\n", agent);
        return block_status(agent);
    }
    const char *path = getenv("GUARD_SOCKET");
    if (!path || !*path) return fail(input, "GUARD_SOCKET is not set");
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path) return fail(input, "GUARD_SOCKET is too long");
    strcpy(addr.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
        char why[512];
        snprintf(why, sizeof why, "cannot reach the guard at %s: %s", path, strerror(errno));
        return fail(input, why);
    }
    char head[160];
    int hl = snprintf(head, sizeof head, "{\"v\":%d,\"type\":\"hook\",\"agent\":\"%s\",\"event\":",
                      GUARD_PROTOCOL_VERSION, agent);
    if (write_all(fd, head, (size_t)hl) || write_all(fd, input, len) || write_all(fd, "}\n", 2))
        return fail(input, "lost the guard while sending");
    static char reply[1 << 16];
    size_t got = 0;
    while (got + 1 < sizeof reply) {
        ssize_t n = read(fd, reply + got, sizeof reply - 1 - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += (size_t)n;
        if (memchr(reply, '\n', got)) break;
    }
    reply[got] = '\0';
    close(fd);
    const char *ok = strstr(reply, "\"ok\":true");
    const char *ex = strstr(reply, "\"exit\":");
    if (!ok || !ex) return fail(input, got ? reply : "the guard closed the connection without replying");
    int code = atoi(ex + 7);
    const char *text = strstr(reply, "\"stderr\":\"");
    if (text && text[10] != '"') print_json_string(text + 10);
    return code;
}
