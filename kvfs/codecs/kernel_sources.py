"""The C sources of the codec kernel (kvfs/codecs/_entropy*.so), relative to the repository root.

Plain data, no imports: setup.py reads it with runpy before kvfs is installed, and tests/test_entropy.py
builds a portable variant from the same list.
"""

HUF0 = "kvfs/codecs/huf0"  # zstd's Huffman coder, vendored (huf0/README.md)
C_SOURCES = ["kvfs/codecs/_entropy.c", "kvfs/codecs/_classes.c", "kvfs/codecs/_entropy8.c", "kvfs/codecs/_sections.c",
             "kvfs/codecs/_xxh3.c", "kvfs/codecs/_object.c", "kvfs/codecs/_encode.c",
             "kvfs/codecs/_scratch.c",
             f"{HUF0}/common/entropy_common.c", f"{HUF0}/common/error_private.c", f"{HUF0}/common/debug.c",
             f"{HUF0}/common/fse_decompress.c", f"{HUF0}/compress/fse_compress.c", f"{HUF0}/compress/hist.c",
             f"{HUF0}/compress/huf_compress.c", f"{HUF0}/decompress/huf_decompress.c"]
X86_64_ASM = f"{HUF0}/decompress/huf_decompress_amd64.S"  # huff0's decode loops (BMI2, chosen at run time)
