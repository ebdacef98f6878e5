/*
 * guardfs._fusereply: the open flags pyfuse3 cannot set.
 *
 * pyfuse3 (3.5) replies to OPEN and OPENDIR with the fuse_file_info it was given, setting
 * only fh, direct_io, keep_cache and nonseekable. Two flags of libfuse's struct matter to
 * the guard and are out of its reach:
 *
 *   cache_readdir (FOPEN_CACHE_DIR): the kernel keeps a directory's listing in its page
 *     cache and serves the next opendir/getdents from it until the directory changes
 *     (through the mount, or its mtime as our getattr reports it). Build tools list the
 *     same directories tens of thousands of times (setuptools' egg_info globs the whole
 *     tree once per MANIFEST.in rule); each listing is otherwise two READDIRPLUS requests
 *     with a stat per name.
 *   noflush (FOPEN_NOFLUSH): close(2) of a descriptor opened for reading sends no FLUSH,
 *     a synchronous round trip that does nothing for a read-only file.
 *
 * This module, loaded with RTLD_GLOBAL before the first reply (guardfs/__init__.py), defines
 * fuse_reply_open; the dynamic linker binds pyfuse3's call to it (global scope first) and
 * it calls libfuse's own. guardfs asks for the flags in the top byte of the file handle it
 * returns (guardfs.fusereply), which this strips before the kernel sees it, so every later
 * request carries the handle guardfs knows. The kernel keeps handles opaque; guardfs's own
 * stay far below 2^56.
 *
 * guardfs sets no flag until this has seen a reply pass (seen() > 0): where the linker
 * bound pyfuse3 elsewhere (LD_BIND_NOW before this was loaded), no handle ever carries a
 * flag the kernel would keep.
 *
 * Directories without OPENDIR. Even with listings cached, every opendir(3) costs an OPENDIR
 * and a RELEASEDIR round trip (setuptools' ~50,000 per pip install -e . of Django). When a
 * filesystem answers OPENDIR with ENOSYS, the kernel stops sending OPENDIR and RELEASEDIR
 * for the mount and caches every listing by default (fs/fuse/file.c: "Default for
 * no-open"); READDIRPLUS then comes with file handle 0, and pyfuse3 hands its handler the
 * handle alone, never the inode. This module also defines fuse_session_new, through which
 * pyfuse3 registers its operations, and wraps the directory ones that take a handle
 * (readdirplus, readdir, fsyncdir) so that a request with handle 0 reaches pyfuse3 with the
 * directory's inode as its handle (never 0 in FUSE). Once OPENDIR has answered ENOSYS no
 * directory has a handle of its own, so guardfs reads every directory handle as an inode
 * (no marker bit: inode numbers may use all 64). guardfs answers OPENDIR with ENOSYS only
 * when dirs_by_inode() says the wrapping took place.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>

#define FUSE_USE_VERSION 35
#include <fuse3/fuse_lowlevel.h>

#define FLAG_SHIFT 56
#define FLAG_CACHE_DIR 1u
#define FLAG_NOFLUSH 2u

typedef int (*reply_open_fn)(fuse_req_t, const struct fuse_file_info *);
typedef struct fuse_session *(*session_new_fn)(struct fuse_args *, const struct fuse_lowlevel_ops *, size_t, void *);
typedef void (*list_fn)(fuse_req_t, fuse_ino_t, size_t, off_t, struct fuse_file_info *);
typedef void (*fsyncdir_fn)(fuse_req_t, fuse_ino_t, int, struct fuse_file_info *);

static reply_open_fn real_reply_open;
static unsigned long long replies_seen;
static unsigned long long flags_applied;

static struct fuse_lowlevel_ops wrapped_ops;
static list_fn their_readdir, their_readdirplus;
static fsyncdir_fn their_fsyncdir;
static int ops_wrapped;

static void *libfuse_symbol(const char *name)
{
    /* libfuse is loaded by now (pyfuse3, which calls us, needs it); look the symbol up in
     * its own scope, never the global one, which finds our own definition again. */
    void *lib = dlopen("libfuse3.so.3", RTLD_LAZY | RTLD_NOLOAD);
    return lib == NULL ? NULL : dlsym(lib, name);
}

static reply_open_fn find_real(void)
{
    return (reply_open_fn)libfuse_symbol("fuse_reply_open");
}

/* The handle pyfuse3 passes on: the kernel's, or for a directory opened without OPENDIR
 * (handle 0), its inode. pyfuse3 copies the handle before returning. */
static struct fuse_file_info by_inode(const struct fuse_file_info *fi, fuse_ino_t ino)
{
    struct fuse_file_info out = *fi;
    if (out.fh == 0)
        out.fh = (uint64_t)ino;
    return out;
}

static void readdir_by_inode(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    struct fuse_file_info out = by_inode(fi, ino);
    their_readdir(req, ino, size, off, &out);
}

static void readdirplus_by_inode(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    struct fuse_file_info out = by_inode(fi, ino);
    their_readdirplus(req, ino, size, off, &out);
}

static void fsyncdir_by_inode(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi)
{
    struct fuse_file_info out = by_inode(fi, ino);
    their_fsyncdir(req, ino, datasync, &out);
}

struct fuse_session *fuse_session_new(struct fuse_args *args, const struct fuse_lowlevel_ops *op, size_t op_size,
                                      void *userdata)
{
    session_new_fn real = (session_new_fn)libfuse_symbol("fuse_session_new");
    if (real == NULL)
        return NULL;
    if (op_size != sizeof wrapped_ops) {  /* another libfuse's layout: as it is, by handle */
        ops_wrapped = 0;
        return real(args, op, op_size, userdata);
    }
    wrapped_ops = *op;
    their_readdir = op->readdir;
    their_readdirplus = op->readdirplus;
    their_fsyncdir = op->fsyncdir;
    if (their_readdir != NULL)
        wrapped_ops.readdir = readdir_by_inode;
    if (their_readdirplus != NULL)
        wrapped_ops.readdirplus = readdirplus_by_inode;
    if (their_fsyncdir != NULL)
        wrapped_ops.fsyncdir = fsyncdir_by_inode;
    struct fuse_session *se = real(args, &wrapped_ops, sizeof wrapped_ops, userdata);
    ops_wrapped = se != NULL;
    return se;
}

int fuse_reply_open(fuse_req_t req, const struct fuse_file_info *fi)
{
    if (real_reply_open == NULL && (real_reply_open = find_real()) == NULL)
        return fuse_reply_err(req, EIO);
    replies_seen++;
    unsigned flags = (unsigned)(fi->fh >> FLAG_SHIFT);
    if (flags == 0)
        return real_reply_open(req, fi);
    struct fuse_file_info out = *fi;
    out.fh &= (UINT64_C(1) << FLAG_SHIFT) - 1;
    if (flags & FLAG_CACHE_DIR) {
        out.cache_readdir = 1;
        out.keep_cache = 1;  /* keep what is cached from an earlier opendir */
    }
    if (flags & FLAG_NOFLUSH)
        out.noflush = 1;
    flags_applied++;
    return real_reply_open(req, &out);
}

static PyObject *seen(PyObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(replies_seen);
}

static PyObject *applied(PyObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(flags_applied);
}

static PyObject *dirs_by_inode(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(ops_wrapped);
}

static PyMethodDef methods[] = {
    {"dirs_by_inode", dirs_by_inode, METH_NOARGS,
     "Whether the session's directory operations get the inode for handle 0."},
    {"seen", seen, METH_NOARGS, "Replies to OPEN and OPENDIR that passed through here."},
    {"applied", applied, METH_NOARGS, "Replies whose handle asked for a flag (and got it)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "guardfs._fusereply",
    "fuse_reply_open with the open flags pyfuse3 cannot set (see the C source).", -1, methods,
};

PyMODINIT_FUNC PyInit__fusereply(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "FLAG_SHIFT", FLAG_SHIFT) < 0
        || PyModule_AddIntConstant(m, "CACHE_DIR", FLAG_CACHE_DIR) < 0
        || PyModule_AddIntConstant(m, "NOFLUSH", FLAG_NOFLUSH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
