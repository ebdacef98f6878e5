# guardfs before pyfuse3 in the test process too (guardfs.fusereply says why).
import guardfs  # noqa: F401
