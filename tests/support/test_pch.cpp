// The translation unit that builds the tests' shared precompiled header (tests/CMakeLists.txt,
// PD_TEST_PCH): the header is compiled once with the tests' flags, and every pd_add_test target
// reuses it. Nothing here is linked into a test.
