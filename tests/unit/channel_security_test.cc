#include "proto/channel_security.h"

#include <fstream>

#include "gtest/gtest.h"
#include "tests/support/status_assertions.h"

namespace shard {
namespace {

std::string WriteTemp(const std::string& name, const std::string& content) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << content;
  return path;
}

TEST(ChannelSecurityTest, ATokenFileHoldsOnePrintableLine) {
  SHARD_ASSERT_OK_AND_ASSIGN(const std::string token,
                             ReadTokenFile(WriteTemp("good.token", "  s3cret-Token_1\n")));
  EXPECT_EQ(token, "s3cret-Token_1");
  for (const std::string& bad : {std::string("\n"), std::string("two words\n"),
                                 std::string(5000, 'a'), std::string("tab\there")}) {
    absl::StatusOr<std::string> token = ReadTokenFile(WriteTemp("bad.token", bad));
    ASSERT_FALSE(token.ok()) << bad;
    EXPECT_EQ(token.status().message().find(bad), std::string::npos) << "never echoed";
  }
  EXPECT_FALSE(ReadTokenFile("/nonexistent/token").ok());
}

TEST(ChannelSecurityTest, TokensCompareExactly) {
  EXPECT_TRUE(TokensEqual("abc", "abc"));
  EXPECT_FALSE(TokensEqual("abd", "abc"));
  EXPECT_FALSE(TokensEqual("ab", "abc"));
  EXPECT_FALSE(TokensEqual("abcd", "abc"));
  EXPECT_FALSE(TokensEqual("", ""));
}

TEST(ChannelSecurityTest, InconsistentTlsFlagsAreClearErrors) {
  ClientSecurityFiles cert_without_ca;
  cert_without_ca.cert = WriteTemp("c.pem", "-----BEGIN CERTIFICATE-----\n");
  cert_without_ca.key = cert_without_ca.cert;
  EXPECT_NE(LoadClientSecurity(cert_without_ca).status().message().find("--tls-ca"),
            std::string::npos);
  ClientSecurityFiles not_pem;
  not_pem.ca = WriteTemp("ca.txt", "hello");
  EXPECT_NE(LoadClientSecurity(not_pem).status().message().find("not a PEM file"),
            std::string::npos);
  ServerSecurityFiles client_ca_only;
  client_ca_only.client_ca = not_pem.ca;
  EXPECT_NE(LoadServerCredentials(client_ca_only).status().message().find("--tls-cert"),
            std::string::npos);
  EXPECT_TRUE(LoadServerCredentials({}).ok()) << "plaintext";
}

}  // namespace
}  // namespace shard
